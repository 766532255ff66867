"""A router drops a cached node status on the monitor's own message, not on console events."""

from __future__ import annotations

import asyncio
import time

import pytest

from nodes import events
from router import routing
from router.invalidation import Listener


async def test_the_router_listens_to_its_own_group_only(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = 0

    async def aread(node_id: str) -> dict:
        nonlocal reads
        reads += 1
        return {"nodeId": node_id, "state": "Online", "lastSeen": time.time()}

    monkeypatch.setattr(routing.status_cache, "aread", aread)
    monkeypatch.setattr(routing, "STATUS_TTL", 30.0)  # only a message may drop the entry
    table = routing.RoutingTable()
    listener = Listener(apply=table.invalidate)
    listener.start()
    try:
        await asyncio.wait_for(listener.ready.wait(), 5)
        await table.status("n1")
        assert reads == 1
        # The console's events are for browsers: the routers no longer join "fleet".
        summary = events.NodeSummary(
            nodeId="n1",
            state="Online",
            reasons=[],
            cpuPercent=1.0,
            memoryPercent=None,
            memoryUsedBytes=None,
            memoryTotalBytes=None,
            lastSeen=time.time(),
        )
        await events.publish(events.NodeUpdated(type="node.updated", node=summary))
        await asyncio.sleep(0.3)
        await table.status("n1")
        assert reads == 1, "a telemetry event dropped the router's cached status"
        await events.invalidate_status("n1")
        started = time.monotonic()
        while reads == 1:
            assert time.monotonic() - started < 1.0, "the monitor's message was not applied"
            await asyncio.sleep(0.02)
            await table.status("n1")
    finally:
        await listener.stop()
        from channels.layers import get_channel_layer

        await get_channel_layer().close_pools()
