"""The events stream's hello takes the snapshot again: what changed between the
/status snapshot and the subscription (an engine adopted or Ready in that gap) is not
replayed, and the master must not keep the old state (found by the compose test)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from nodes import status_cache
from nodes.monitor import NodeWorker
from tests.factories import make_node

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis"),
]


async def test_a_hello_of_the_same_boot_takes_the_snapshot_again() -> None:
    node = await sync_to_async(make_node)("n1")
    worker = NodeWorker(node=node, stop=asyncio.Event())
    starting = {"instanceId": "m1-p1", "modelId": 1, "state": "Starting"}
    worker.status.update(state="Online", lastSeen=time.time(), bootId="boot-1")
    worker.status["instances"] = {"m1-p1": starting}
    worker.connected = True
    worker.last_contact = time.time()
    calls: list[int] = []

    async def status() -> dict[str, Any]:
        calls.append(1)
        return {"instances": [{**starting, "state": "Ready"}], "health": {"reasons": []}}

    worker.client.status = status  # type: ignore[method-assign]
    try:
        await worker.handle_event("hello", {"bootId": "boot-1", "nodeId": "n1"})
    finally:
        await worker.client.aclose()
    assert calls == [1]
    assert worker.status["instances"]["m1-p1"]["state"] == "Ready"
    stored = await status_cache.aread("n1") or {}
    assert stored["instances"]["m1-p1"]["state"] == "Ready"
