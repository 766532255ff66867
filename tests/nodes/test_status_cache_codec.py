"""The status record's codec: orjson, with json's answers where orjson refuses a value."""

from __future__ import annotations

import math
from typing import Any, cast

import pytest

from nodes import status_cache
from nodes.status_cache import NodeStatus


def _record(node_id: str, **more: Any) -> NodeStatus:
    return cast(NodeStatus, {"nodeId": node_id, "state": "Online", "reasons": [], **more})


@pytest.mark.usefixtures("status_redis")
def test_records_orjson_refuses_are_written_and_read_as_before() -> None:
    # An agent's odd value: an integer past 64 bits.
    status_cache.write(_record("n1", telemetry={"memory": {"totalBytes": 2**70}}))
    written = cast(dict[str, Any], status_cache.read("n1"))
    assert written["telemetry"]["memory"]["totalBytes"] == 2**70
    # A record an earlier release wrote with json.dumps, NaN included.
    status_cache.sync_client().set(
        status_cache._key("n2"), '{"nodeId": "n2", "state": "Online", "cpu": NaN}'
    )
    assert math.isnan(cast(dict[str, Any], status_cache.read("n2"))["cpu"])
    plain = _record("n3", lastSeen=2.5)
    status_cache.write(plain)
    read = dict(status_cache.read_many(["n3"])["n3"] or {})
    assert read == plain and isinstance(read["updatedAt"], float)  # written: stamped
