"""The router's node-status cache: one Redis read per node however many requests miss."""

from __future__ import annotations

import asyncio

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
    table.invalidate({"type": "console.event", "event": {"node": {"nodeId": "n1"}}})
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
