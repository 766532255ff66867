"""The router's node-status cache: one Redis read per node however many requests miss."""

from __future__ import annotations

import asyncio
import time as _time
from collections.abc import Callable

import pytest

from router import routing
from router.errors import V1Error


async def test_concurrent_misses_share_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = 0

    async def aread(node_id: str) -> dict:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.05)  # a slow Redis: every request arrives while it reads
        return {"nodeId": node_id, "state": "Online"}

    monkeypatch.setattr(routing.status_cache, "aread", aread)
    table = routing.RoutingTable()
    answers = await asyncio.gather(*(table.status("n1") for _ in range(300)))
    assert reads == 1 and all(a == {"nodeId": "n1", "state": "Online"} for a in answers)
    table.invalidate({"type": "router.invalidate", "kind": "status", "nodeId": "n1"})
    await table.status("n1")
    assert reads == 2  # the monitor's change dropped the entry


async def test_redis_errors_fall_back_then_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    async def ok(node_id: str) -> dict:
        return {"nodeId": node_id, "state": "Online"}

    async def broken(node_id: str) -> dict:
        raise ConnectionError("Redis is away")

    table = routing.RoutingTable()
    monkeypatch.setattr(routing.status_cache, "aread", ok)
    await table.status("n1")
    monkeypatch.setattr(routing.status_cache, "aread", broken)
    monkeypatch.setattr(routing, "STATUS_TTL", 0.0)
    table._statuses["n1"] = (0.0, {"nodeId": "n1", "state": "Online"})  # expired
    assert (await table.status("n1"))["state"] == "Online"  # the last known one
    with pytest.raises(V1Error) as caught:
        await table.status("n2")  # never read: nothing to fall back on
    assert caught.value.status == 503 and caught.value.code == "server_busy"


async def test_a_status_expired_just_now_is_served_while_one_read_refreshes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = 0
    current = {"nodeId": "n1", "state": "Online", "v": 1}

    async def aread(node_id: str) -> dict:
        nonlocal reads
        reads += 1
        answer = dict(current)
        await asyncio.sleep(0.05)
        return answer

    monkeypatch.setattr(routing.status_cache, "aread", aread)
    table = routing.RoutingTable()
    assert (await table.status("n1"))["v"] == 1
    _expiry, entry = table._statuses["n1"]
    table._statuses["n1"] = (_time.monotonic() - 0.1, entry)  # expired a moment ago
    current["v"] = 2
    started = _time.monotonic()
    answers = await asyncio.gather(*(table.status("n1") for _ in range(50)))
    assert _time.monotonic() - started < 0.04, "nobody may wait for the refresh"
    assert [a["v"] for a in answers] == [1] * 50 and reads == 2
    await asyncio.sleep(0.1)
    assert (await table.status("n1"))["v"] == 2 and reads == 2
    # Long expired (no request for a while): the read is awaited, not the old entry.
    table._statuses["n1"] = (_time.monotonic() - 2 * routing.STATUS_STALE, entry)
    assert (await table.status("n1"))["v"] == 2 and reads == 3


async def test_a_status_change_during_a_read_discards_its_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def aread(node_id: str) -> dict:
        answer = {"nodeId": node_id, "state": "Online"}  # read before the change below
        await asyncio.sleep(0.1)
        return answer

    monkeypatch.setattr(routing.status_cache, "aread", aread)
    table = routing.RoutingTable()
    first = asyncio.ensure_future(table.status("n1"))
    await asyncio.sleep(0.02)
    table.invalidate({"type": "router.invalidate", "kind": "status", "nodeId": "n1"})
    assert (await first)["state"] == "Online"  # the request that asked before the change
    assert "n1" not in table._statuses  # ...but its answer is not cached


def _slow_loader(
    calls: list[str], answers: dict[str, object], delay: float = 0.05
) -> Callable[[str], object]:

    def load(name: str) -> object:
        calls.append(name)
        value = answers.get(name)  # read first: a change after this is not in the answer
        _time.sleep(delay)  # a slow database: requests keep arriving while it runs
        return value

    return load


async def test_route_misses_share_one_query(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(routing, "_load_route", _slow_loader(calls, {"m": "route-m"}))
    table = routing.RoutingTable()
    answers = await asyncio.gather(*(table.route("m") for _ in range(64)))
    assert calls == ["m"] and set(answers) == {"route-m"}


async def test_an_expired_route_is_served_while_one_refresh_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    answers = {"m": "old"}
    monkeypatch.setattr(routing, "_load_route", _slow_loader(calls, answers))
    table = routing.RoutingTable()
    assert await table.route("m") == "old"
    table._routes["m"] = (0.0, "old")  # expired
    answers["m"] = "new"
    # Every request gets the stale answer at once; one query replaces it behind them.
    assert await asyncio.gather(*(table.route("m") for _ in range(64))) == ["old"] * 64
    await asyncio.sleep(0.2)
    assert calls == ["m", "m"] and await table.route("m") == "new"


async def test_a_change_during_a_query_discards_its_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    answers: dict[str, object] = {"k": "valid key"}
    monkeypatch.setattr(routing.keys, "lookup", _slow_loader(calls, answers, delay=0.2))
    table = routing.RoutingTable()
    first = asyncio.ensure_future(table._cached(table._keys, "k", 10.0, routing.keys.lookup))
    await asyncio.sleep(0.05)  # the query has read the key; now it is revoked
    answers["k"] = None
    table.invalidate({"kind": "keys"})
    assert await first == "valid key"  # the request that asked before the change
    assert "k" not in table._keys  # ...but its answer is not cached
    assert await table._cached(table._keys, "k", 10.0, routing.keys.lookup) is None
    assert calls == ["k", "k"]


async def test_a_failed_key_load_never_logs_the_key(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(name: str) -> object:
        raise RuntimeError("database away")

    monkeypatch.setattr(routing.keys, "lookup", broken)
    table = routing.RoutingTable()
    with pytest.raises(RuntimeError):
        await table.key("mb-secret-token-123")
    assert "database away" in caplog.text
    assert "mb-secret-token-123" not in caplog.text


async def test_the_model_list_is_cached_until_a_route_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/v1/models used to query every served name on every call."""
    calls: list[str] = []
    names = ["a", "b"]

    def all_names(_: str = "") -> list[str]:
        calls.append("names")
        return list(names)

    def all_aliases(_: str = "") -> list[str]:
        calls.append("aliases")
        return []

    monkeypatch.setattr(routing, "_all_served_names", all_names)
    monkeypatch.setattr(routing, "_all_alias_names", all_aliases)
    monkeypatch.setattr(routing, "_load_route", lambda name: None)
    table = routing.RoutingTable()
    for _ in range(5):
        assert await table.ready_models() == []  # no route: nothing ready
    assert calls == ["names", "aliases"]
    names.append("c")
    table.invalidate({"kind": "routes", "name": "c"})
    await table.ready_models()
    assert calls == ["names", "aliases", "names", "aliases"]
