"""nodes.telemetry: points from samples, the two bounded lists in Redis, current or not."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer

from nodes import events, monitor_worker, status_cache, telemetry
from nodes.monitor import NodeWorker
from nodes.telemetry import Point
from tests.channels_catcher import Catcher, kinds
from tests.nodes.conftest import Enrolled
from tests.telemetry_support import GIB, engine, history, sample

__all__ = ["history"]  # the fixture, imported to be used

T0 = 1_700_000_040.0  # the start of a minute


def _point(s: dict[str, Any], previous: Point | None = None, now: float = T0) -> Point:
    return telemetry.point_from_sample(s, previous, now)


# -- point_from_sample -------------------------------------------------------------------


def test_a_full_sample_becomes_a_point() -> None:
    p = _point(sample(engine("m1-p1", running=2, waiting=1, prompt=100, gen=50, kv_tokens=4096)))
    assert p["t"] == T0
    assert (p["cpu"], p["memUsed"], p["memTotal"], p["load1"]) == (12.5, 6 * GIB, 16 * GIB, 0.5)
    assert p["gpus"] == [{"index": 0, "memUsed": 20 * GIB, "memTotal": 80 * GIB, "util": 55.0}]
    e = p["engines"]["m1-p1"]
    assert (e["cpu"], e["rss"], e["running"], e["waiting"]) == (120.0, 3 * GIB, 2, 1)
    assert (e["kv"], e["kvTokens"], e["prefixHit"]) == (0.25, 4096, 0.5)
    assert (e["promptTotal"], e["genTotal"]) == (100, 50)
    assert e["promptTps"] is None and e["genTps"] is None  # the first point has no rates


def test_absent_keys_are_unknown_never_zero() -> None:
    p = _point({"engines": [engine("m1-p1", scraped=False, cpu=None, rss=None)]})
    assert (p["cpu"], p["memUsed"], p["memTotal"], p["load1"], p["gpus"]) == (
        None,
        None,
        None,
        None,
        [],
    )
    assert set(p["engines"]["m1-p1"].values()) == {None}
    bad = _point(
        {
            "cpuPercent": "12",
            "memory": {"usedBytes": True, "totalBytes": float("nan")},
            "load": [],
            "gpus": [{"index": "0"}, {"index": True}, {"index": 1, "utilizationPercent": 5}],
            "engines": [{"instanceId": "bad id!"}, {"instanceId": 7}, "x", {"pid": 1}],
        }
    )
    assert (bad["cpu"], bad["memUsed"], bad["memTotal"], bad["load1"]) == (None,) * 4
    assert bad["gpus"] == [{"index": 1, "memUsed": None, "memTotal": None, "util": 5.0}]
    assert bad["engines"] == {}  # only valid instance ids are kept
    assert _point("not a dict")["engines"] == {}


def test_rates_come_from_the_previous_point_of_the_same_instance() -> None:
    first = _point(sample(engine("a", prompt=1000, gen=100), engine("b", prompt=5, gen=5)))
    second = _point(
        sample(engine("a", prompt=1500, gen=150), engine("c", prompt=9, gen=9)),
        first,
        T0 + 5,
    )
    assert second["engines"]["a"]["promptTps"] == 100.0
    assert second["engines"]["a"]["genTps"] == 10.0
    assert second["engines"]["c"]["genTps"] is None  # new instance: no previous counter


def test_no_rate_after_a_restart_or_a_gap() -> None:
    first = _point(sample(engine("a", prompt=1000, gen=100)))
    restarted = _point(sample(engine("a", prompt=10, gen=2)), first, T0 + 5)
    assert restarted["engines"]["a"]["promptTps"] is None
    assert restarted["engines"]["a"]["genTps"] is None
    late = _point(sample(engine("a", prompt=2000, gen=200)), first, T0 + 31)
    assert late["engines"]["a"]["genTps"] is None
    just = _point(sample(engine("a", prompt=2000, gen=200)), first, T0 + 30)
    assert just["engines"]["a"]["genTps"] == pytest.approx(100 / 30)
    unknown = _point(sample(engine("a", prompt=None, gen=200)), first, T0 + 5)
    assert unknown["engines"]["a"]["promptTps"] is None


def test_engines_and_gpus_are_bounded() -> None:
    many = sample(
        *(engine(f"e{i}") for i in range(200)),
        gpus=[{"index": i, "memoryUsedBytes": 1} for i in range(100)],
    )
    p = _point(many)
    assert len(p["engines"]) == telemetry.MAX_ENGINES and len(p["gpus"]) == telemetry.MAX_GPUS


# -- downsample --------------------------------------------------------------------------


def test_downsample_averages_and_ignores_nones() -> None:
    a = _point(sample(engine("x", prompt=100, gen=10, kv=0.2), cpu=10.0), now=T0 + 1)
    b = _point(sample(engine("x", prompt=200, gen=20, kv=None), cpu=30.0), a, T0 + 6)
    c = _point({"engines": [engine("x", scraped=False)]}, b, T0 + 11)
    d = telemetry.downsample([a, b, c])
    assert d["t"] == T0  # the minute's start
    assert d["cpu"] == 20.0  # c's None is ignored
    assert d["memUsed"] == 6 * GIB
    x = d["engines"]["x"]
    assert x["kv"] == pytest.approx(0.2)  # only a had it
    assert x["promptTps"] == pytest.approx(20.0)  # only b had a rate
    assert x["genTotal"] == 20  # counters: the last known
    assert x["running"] == 1
    assert d["gpus"] == [{"index": 0, "memUsed": 20 * GIB, "memTotal": 80 * GIB, "util": 55.0}]
    nothing = telemetry.downsample([c])
    assert nothing["cpu"] is None and nothing["engines"]["x"]["kv"] is None  # a gap, not 0
    with pytest.raises(ValueError):
        telemetry.downsample([])


def test_encode_decode_round_trip() -> None:
    p = _point(sample(engine("m1-p1", kv_tokens=12.0), engine("m2-p2", scraped=False)))
    assert telemetry.decode(telemetry.encode(p)) == p
    assert telemetry.decode("[2,1]") is None and telemetry.decode("{") is None
    assert telemetry.decode(None) is None


# -- Redis -------------------------------------------------------------------------------


def _record(node_id: str, s: dict[str, Any], now: float) -> Point:
    return asyncio.run(telemetry.arecord(node_id, s, now=now))


@pytest.mark.usefixtures("history")
def test_recorded_samples_make_both_series() -> None:
    for i in range(14):  # 70 s: one whole minute and a bit of the next
        _record("n1", sample(engine("a", prompt=100 * i, gen=10 * i), cpu=float(i)), T0 + 5 * i)
    now = T0 + 66
    fine = telemetry.series("n1", "1h", now=now)
    assert [p["t"] for p in fine] == [T0 + 5 * i for i in range(14)]
    assert fine[0]["engines"]["a"]["genTps"] is None
    assert all(p["engines"]["a"]["genTps"] == 2.0 for p in fine[1:])
    coarse = telemetry.series("n1", "24h", now=now)
    assert [p["t"] for p in coarse] == [T0, T0 + 60]
    assert coarse[0]["cpu"] == pytest.approx(sum(range(12)) / 12)  # samples 0..11
    assert coarse[1]["cpu"] == pytest.approx(12.5)  # the current minute so far: 12, 13
    assert coarse[0]["engines"]["a"]["genTps"] == 2.0  # the mean ignores the first None
    client = status_cache.sync_client()
    assert 0 < client.ttl(telemetry.fine_key("n1")) <= telemetry.FINE_TTL_SECONDS
    assert 3600 < client.ttl(telemetry.coarse_key("n1")) <= telemetry.COARSE_TTL_SECONDS
    # What the window leaves out is not returned.
    assert telemetry.series("n1", "1h", now=T0 + 3600 + 31)[0]["t"] == T0 + 35
    with pytest.raises(ValueError, match="window must be one of 1h, 24h"):
        telemetry.series("n1", "7d")  # type: ignore[arg-type]  # the refusal under test


@pytest.mark.usefixtures("history")
def test_holes_are_marked_so_charts_break() -> None:
    for t in (T0, T0 + 5, T0 + 100, T0 + 300):
        _record("n1", sample(), t)
    fine = telemetry.series("n1", "1h", now=T0 + 300)
    assert [p["t"] for p in fine] == [T0, T0 + 5, T0 + 10, T0 + 100, T0 + 105, T0 + 300]
    assert fine[2] == telemetry.empty_point(T0 + 10)
    coarse = telemetry.series("n1", "24h", now=T0 + 300)
    assert [p["t"] for p in coarse] == [T0, T0 + 60, T0 + 120, T0 + 300]
    assert coarse[2]["cpu"] is None  # minutes 2-4 had no sample


@pytest.mark.usefixtures("history")
def test_both_lists_are_bounded() -> None:
    async def fill() -> None:
        for i in range(telemetry.COARSE_POINTS + 10):  # one sample a minute
            await telemetry.arecord("n1", sample(), now=T0 + 60 * i)

    asyncio.run(fill())
    client = status_cache.sync_client()
    assert client.llen(telemetry.fine_key("n1")) == telemetry.FINE_POINTS
    assert client.llen(telemetry.coarse_key("n1")) == telemetry.COARSE_POINTS
    coarse = telemetry.series("n1", "24h", now=T0 + 60 * (telemetry.COARSE_POINTS + 9))
    assert coarse[0]["t"] == T0 + 60 * 10 and len(coarse) == telemetry.COARSE_POINTS


@pytest.mark.usefixtures("history")
@pytest.mark.parametrize(("gpu_count", "engine_count", "kib"), [(1, 1, 300), (2, 3, 600)])
def test_a_node_keeps_a_few_hundred_kb(gpu_count: int, engine_count: int, kib: int) -> None:
    """Full lists (1 h fine, 24 h coarse) with realistic values, as Redis counts them."""
    client = status_cache.sync_client()
    previous = None
    for i in range(telemetry.FINE_POINTS):
        engines = [
            engine(f"m{n}-p{n}", running=3, waiting=1, prompt=123_456 + 977 * i,
                   gen=654_321 + 311 * i, kv=0.123456 + i / 7777, kv_tokens=23_456 + i,
                   prefix_hit=0.734567, rss=3_456_789_012 + i, cpu=123.456)
            for n in range(engine_count)
        ]  # fmt: skip
        gpus = [
            {"index": g, "memoryTotalBytes": 85_899_345_920, "memoryUsedBytes": 12_345_678_901 + i,
             "utilizationPercent": 45.678}
            for g in range(gpu_count)
        ]  # fmt: skip
        point = telemetry.point_from_sample(
            sample(*engines, cpu=33.333, gpus=gpus), previous, T0 + 5 * i
        )
        previous = point
        client.rpush(telemetry.fine_key("n1"), telemetry.encode(point))
    for _ in range(telemetry.COARSE_POINTS):
        coarse = telemetry.encode(telemetry.downsample([point]), counters=False)  # as arecord
        client.rpush(telemetry.coarse_key("n1"), coarse)
    used = sum(
        client.memory_usage(k) or 0 for k in (telemetry.fine_key("n1"), telemetry.coarse_key("n1"))
    )
    print(f"history of one node ({gpu_count} GPUs, {engine_count} engines): {used / 1024:.0f} KiB")
    assert used < kib * 1024


@pytest.mark.usefixtures("history")
def test_latest_is_never_older_than_a_minute() -> None:
    _record("n1", sample(cpu=1.0), T0)
    _record("n2", sample(cpu=2.0), T0 + 30)
    assert telemetry.latest("n1", now=T0 + 60) is not None
    assert telemetry.latest("n1", now=T0 + 60.5) is None
    many = telemetry.latest_many(["n1", "n2", "gone"], now=T0 + 61)
    assert many["n1"] is None and many["gone"] is None
    assert many["n2"] is not None and many["n2"]["cpu"] == 2.0
    assert telemetry.latest_many([]) == {}


@pytest.mark.usefixtures("history")
def test_an_unreachable_redis_reads_as_no_history(monkeypatch: pytest.MonkeyPatch) -> None:
    _record("n1", sample(), time.time())
    dead = redis.Redis(unix_socket_path="/nonexistent/redis.sock", socket_timeout=0.2)
    monkeypatch.setattr(status_cache, "_read_client", dead)
    assert telemetry.series("n1", "1h") == []
    assert telemetry.latest("n1") is None
    assert telemetry.recent_many(["n1"], 300) == {"n1": []}


# -- the monitor -------------------------------------------------------------------------


@pytest.fixture
async def layer_pools() -> AsyncIterator[None]:
    yield
    await get_channel_layer().close_pools()  # its connections belong to this test's loop


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "history", "layer_pools")
async def test_the_monitor_records_each_sample_and_tells_the_node_page_only(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real agent's /telemetry, pulled by the worker: history grows, node.telemetry goes
    to node.<id> and not to the fleet."""
    monkeypatch.setattr(monitor_worker, "TELEMETRY_INTERVAL", 0.05)
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    await worker.connect()
    async with Catcher(events.FLEET_GROUP) as fleet, Catcher(events.node_group("n1")) as page:
        task = asyncio.create_task(worker.poll_telemetry())
        try:
            started = time.monotonic()
            while len(await sync_to_async(telemetry.series)("n1", "1h")) < 2:
                assert time.monotonic() - started < 10, "no history recorded"
                await asyncio.sleep(0.05)
        finally:
            worker.stop.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        on_page = await page.drain(0.3)
        on_fleet = await fleet.drain(0.3)
    await worker.client.aclose()
    assert "node.telemetry" in kinds(on_page)
    assert "node.telemetry" not in kinds(on_fleet) and "node.updated" in kinds(on_fleet)
    event = next(m["event"] for m in on_page if m["event"]["type"] == "node.telemetry")
    assert event["nodeId"] == "n1"
    assert event["point"]["memTotal"] and event["point"]["memTotal"] > 0  # the agent's own memory
    assert math.isclose(event["point"]["t"], time.time(), abs_tol=10)
    assert telemetry.latest("n1") is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "history")
async def test_a_failed_record_keeps_the_connection(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sample the history cannot take (a bug, an odd agent) is logged; the node's record
    in the same transaction is still written."""

    def broken(*args: object, **kwargs: object) -> Point:
        raise ValueError("odd sample")

    monkeypatch.setattr(telemetry, "stage", broken)
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    worker.status["telemetry"] = sample()
    await worker.take_telemetry(sample())  # does not raise
    await worker.client.aclose()
    assert "recording its telemetry failed" in caplog.text
    written = await status_cache.aread("n1")
    assert written is not None and written["telemetry"]["memory"]["totalBytes"] == 16 * GIB


async def _history_grows(worker: NodeWorker) -> None:
    task = asyncio.create_task(worker.run())
    try:
        started = time.monotonic()
        while len(await sync_to_async(telemetry.series)("n1", "1h")) < 2:
            assert time.monotonic() - started < 10, "no history recorded"
            await asyncio.sleep(0.05)
    finally:
        worker.stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "history", "layer_pools")
async def test_heartbeats_bring_the_samples_and_only_an_older_agent_is_polled(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent with events.telemetry sends its sample in each heartbeat: the worker makes
    no /telemetry request. Without the feature the worker pulls, as before."""
    from agent.http import _server

    monkeypatch.setattr(monitor_worker, "TELEMETRY_INTERVAL", 0.05)
    pulls = 0
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    pull = worker.client.telemetry

    async def counted() -> dict[str, Any]:
        nonlocal pulls
        pulls += 1
        return await pull()

    monkeypatch.setattr(worker.client, "telemetry", counted)
    await _history_grows(worker)
    assert worker.telemetry_pushed and pulls == 0
    assert (await status_cache.aread("n1") or {}).get("telemetry", {}).get("memory")
    await worker.client.aclose()

    await sync_to_async(status_cache.sync_client().delete)(telemetry.fine_key("n1"))
    monkeypatch.setattr(
        _server, "FEATURES", [f for f in _server.FEATURES if f != "events.telemetry"]
    )
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    pull = worker.client.telemetry
    monkeypatch.setattr(worker.client, "telemetry", counted)
    await _history_grows(worker)
    assert not worker.telemetry_pushed and pulls >= 2
    await worker.client.aclose()
