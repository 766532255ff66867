"""The Overview's tokens/s and queue tiles sum two engine fields over the fleet's current
telemetry (nodes.telemetry.engine_sums) from a small record per node written beside each
point, without reading or decoding the points (issue 19): the same values as summing the
decoded points (telemetry.latest_many), stale and missing ones left out, a dash when
nothing is known."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from nodes import status_cache, telemetry
from tests.factories import make_node, set_status
from tests.telemetry_support import engine, history, sample

__all__ = ["history"]  # the fixture, imported to be used

FIELDS = ("genTps", "waiting", "running", "kv", "promptTps", "cpu")


@pytest.fixture(autouse=True)
def no_sums() -> Iterator[None]:
    """The sums records emptied before and after (the history fixture empties the lists)."""

    def clear() -> None:
        client = status_cache.sync_client()
        for key in client.scan_iter(f"{telemetry.SUMS_PREFIX}*"):
            client.delete(key)

    clear()
    yield
    clear()


def _record(node_id: str, *points: tuple[float, dict[str, Any]]) -> None:
    async def run() -> None:
        for at, value in points:
            await telemetry.arecord(node_id, value, now=at)

    asyncio.run(run())


def _decoded_sums(node_ids: list[str], now: float) -> dict[str, float | None]:
    """The sums over whole decoded points: what the tiles showed before."""
    out: dict[str, float | None] = {}
    points = telemetry.latest_many(node_ids, now)
    for field in FIELDS:
        known = [
            e[field]  # type: ignore[literal-required]  # a field of EnginePoint
            for p in points.values()
            if p
            for e in p["engines"].values()
            if isinstance(e[field], int | float)  # type: ignore[literal-required]
        ]
        out[field] = sum(known) if known else None
    return out


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis", "history")
def test_engine_sums_equal_the_decoded_points(operator: Any) -> None:
    now = time.time()
    busy = (sample(engine("a", waiting=3, gen=0), engine("b", waiting=1, gen=0)),
            sample(engine("a", waiting=2, gen=500), engine("b", waiting=4, gen=250)))  # fmt: skip
    _record("n1", (now - 10, busy[0]), (now - 5, busy[1]))
    _record("n2", (now - 10, sample(engine("c", waiting=5, gen=0))),
            (now - 5, sample(engine("c", waiting=7, gen=100, kv=None))))  # fmt: skip
    _record("stale", (now - 130, busy[0]), (now - 125, busy[1]))  # over a minute old
    _record("quiet", (now - 5, sample(engine("d", scraped=False))))  # no metrics at all
    _record("idle", (now - 5, sample()))  # no engine
    status_cache.sync_client().rpush(telemetry.fine_key("broken"), "[1, 2")
    ids = ["n1", "n2", "stale", "quiet", "idle", "broken", "none"]

    sums = telemetry.engine_sums(ids, FIELDS, now)
    assert sums == _decoded_sums(ids, now)
    assert sums["waiting"] == 2 + 4 + 7
    assert sums["genTps"] == pytest.approx((500 + 250 + 100) / 5, abs=0.5)  # stored rounded
    unknown = telemetry.engine_sums(["quiet", "idle", "stale"], FIELDS, now)
    assert unknown == _decoded_sums(["quiet", "idle", "stale"], now)
    assert unknown["genTps"] is None and unknown["waiting"] is None  # a dash, not 0
    assert unknown["cpu"] == 120.0  # the engine not scraped still has its process's CPU

    for node_id in ("n1", "n2", "stale", "quiet", "idle"):
        set_status(make_node(node_id))
    client = Client()
    client.force_login(operator)
    page = client.get("/overview/summary/").content.decode()
    tps = re.search(r'id="tile-tps"><strong>([^<]*)</strong>', page)
    queue = re.search(r'id="tile-queue"><strong>([^<]*)</strong>', page)
    assert tps and tps.group(1) == f"{sums['genTps']:.1f}"
    assert queue and queue.group(1) == "13"


@pytest.mark.usefixtures("status_redis", "history")
def test_the_sums_come_from_a_small_record_that_expires_with_its_point() -> None:
    """A thousand newest points read and decoded for two tile sums was a tenth of the
    Overview: the record beside each point answers alone, one MGET for the fleet."""
    now = float(int(time.time()))  # whole seconds: a point's time is stored rounded
    _record("n1", (now - 5, sample(engine("a", waiting=3, gen=0), engine("b", waiting=1))),
            (now, sample(engine("a", waiting=2, gen=500), engine("b", waiting=4))))  # fmt: skip
    client = status_cache.sync_client()
    assert 0 < client.ttl(telemetry.sums_key("n1")) <= telemetry.SUMS_TTL_SECONDS
    sums = telemetry.engine_sums(["n1"], FIELDS, now)
    assert sums == _decoded_sums(["n1"], now)
    assert sums["waiting"] == 6 and sums["genTps"] == 100

    client.delete(telemetry.fine_key("n1"), telemetry.coarse_key("n1"))  # the points gone
    assert telemetry.engine_sums(["n1"], FIELDS, now) == sums  # read no point
    assert telemetry.engine_sums(["n1"], FIELDS, now + telemetry.CURRENT_SECONDS + 1) == (
        dict.fromkeys(FIELDS)  # its point is no longer current: a dash
    )
    with pytest.raises(ValueError, match="adds"):
        telemetry.engine_sums(["n1"], ("rss",), now)  # bytes: not a record's sum
    telemetry.forget("n1")
    assert client.exists(telemetry.sums_key("n1")) == 0
