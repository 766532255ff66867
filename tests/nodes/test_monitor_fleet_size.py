"""The monitor at fleet size: what bench/fleet.py found breaking at 100 nodes.

After a master restart a hundred workers wrote their statuses at once; redis-py's
default pool raised MaxConnectionsError past 100 connections, the failed write escaped
the worker's error handling, and the worker ended: its node stayed Offline until the
monitor was restarted (docs/performance.md, "A fleet of a thousand machines").
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.exceptions
from asgiref.sync import sync_to_async

from nodes import monitor_worker as monitor_module
from nodes import status_cache
from nodes.models import Node
from nodes.monitor import Monitor, NodeWorker
from tests.factories import make_node
from tests.nodes.conftest import Enrolled, stop_workers

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity"),
]


async def test_two_hundred_writes_at_once_wait_for_a_connection() -> None:
    client = status_cache.async_client()
    try:
        await asyncio.gather(
            *(status_cache.awrite({"nodeId": f"burst-{i}", "state": "Online"}) for i in range(200))
        )
        assert await client.exists(*(f"mirbad:node:burst-{i}" for i in range(200))) == 200
        assert client.connection_pool.max_connections == status_cache.ASYNC_POOL_CONNECTIONS
    finally:
        await client.delete(*(f"mirbad:node:burst-{i}" for i in range(200)))
        await client.aclose()
        status_cache._async_clients.clear()


async def test_a_failed_status_write_does_not_end_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = await sync_to_async(make_node)("n1")  # https://127.0.0.1:1: nothing listens
    monkeypatch.setattr(monitor_module, "BACKOFF_START", 0.02)
    monkeypatch.setattr(monitor_module, "BACKOFF_MAX", 0.05)
    writes = 0

    async def failing(status: Any) -> None:
        nonlocal writes
        writes += 1
        raise redis.exceptions.MaxConnectionsError("Too many connections")

    monkeypatch.setattr(status_cache, "awrite", failing)
    worker = NodeWorker(node=node, stop=asyncio.Event())
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.sleep(1.0)
        assert not task.done(), task.exception() if task.done() else None
        assert writes >= 3  # it kept trying the node, and recording the loss each time
    finally:
        worker.stop.set()
        await asyncio.wait_for(task, 5)


async def test_refresh_follows_again_a_node_whose_worker_ended() -> None:
    await sync_to_async(make_node)("n1")
    monitor = Monitor(refresh_interval=60)
    await monitor.refresh()
    worker, task = monitor.workers["n1"]
    task.cancel()  # as if it had ended on an error
    await asyncio.gather(task, return_exceptions=True)
    try:
        await monitor.refresh()
        again, running = monitor.workers["n1"]
        assert again is not worker and not running.done()
    finally:
        await stop_workers(monitor)


async def test_a_failed_status_write_keeps_the_agent_connection(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        assert worker.connected

        async def failing(status: Any) -> None:
            raise redis.exceptions.ConnectionError("No connection available.")

        monkeypatch.setattr(status_cache, "awrite", failing)
        # A heartbeat and a state change: both write, neither raises nor drops the agent.
        await worker.handle_event("heartbeat", {"memory": {"totalBytes": 1}})
        await worker.recompute()
        assert worker.connected and worker.save_failing
        monkeypatch.undo()
        await worker.save()
        assert not worker.save_failing
        assert (await status_cache.aread("n1") or {}).get("nodeId") == "n1"
    finally:
        await worker.client.aclose()


async def test_three_hundred_publishes_at_once_wait_for_a_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from channels.layers import get_channel_layer

    from nodes import events

    try:
        await asyncio.gather(
            *(events.invalidate_status(f"burst-{i}") for i in range(300)),
        )
    finally:
        await get_channel_layer().close_pools()
    refused = [r.getMessage() for r in caplog.records if "Could not publish" in r.getMessage()]
    assert refused == []


async def test_a_notification_reads_its_node_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 approvals must not read the 1,000 nodes 1,000 times: a node's change looks at
    that node, and leaves the others' workers alone."""
    for node_id in ("n1", "n2"):
        await sync_to_async(make_node)(node_id)
    monitor = Monitor(refresh_interval=60)
    await monitor.refresh()
    others = monitor.workers["n2"]
    read: list[int] = []
    counted = monitor.load_nodes

    async def counting(only: str | None = None) -> list[Node]:
        found = await counted(only)
        read.append(len(found))
        return found

    monkeypatch.setattr(monitor, "load_nodes", counting)
    try:
        await sync_to_async(Node.objects.filter(node_id="n2").update)(address="https://127.0.0.9:1")
        await sync_to_async(Node.objects.filter(node_id="n1").update)(revoked=True)
        await monitor.node_changed("n1")
        assert "n1" not in monitor.workers and read == [0]  # n1 no longer to follow
        assert monitor.workers["n2"] is others  # n2's change waits for its own notice
        await monitor.node_changed("n2")
        assert monitor.workers["n2"] is not others and read == [0, 1]
    finally:
        await stop_workers(monitor)


async def test_the_masters_own_node_meets_the_connect_gate_first() -> None:
    """After a restart `mirbad up` waits for the bootstrap node: it must not queue at the
    connect gate behind every other node (81 s at 1,000 nodes)."""
    for node_id in ("a1", "a2", "a3"):
        await sync_to_async(make_node)(node_id)
    await sync_to_async(make_node)("zz-local", is_bootstrap=True)
    entered: list[asyncio.Task[Any] | None] = []

    class RecordingGate(asyncio.Semaphore):
        async def acquire(self) -> bool:
            entered.append(asyncio.current_task())
            return await super().acquire()

    monitor = Monitor(refresh_interval=60)
    monitor.connect_gate = RecordingGate(1)
    await monitor.refresh()
    try:
        for _ in range(200):
            if len(entered) >= 4:
                break
            await asyncio.sleep(0.01)
        by_task = {task: node_id for node_id, (_, task) in monitor.workers.items()}
        assert [by_task.get(t) for t in entered[:4]] == ["zz-local", "a1", "a2", "a3"]
    finally:
        await stop_workers(monitor)


async def test_a_connect_leaves_the_gate_and_its_database_work_to_a_task_beside_it(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart's thousand connects: the gate holds only /info and /status, and the
    database work (model rows, facts, operations, auto-start) must not hold up the node
    being Online or the next connect (docs/performance.md)."""
    gate = asyncio.Semaphore(1)
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event(), connect_gate=gate)
    held = asyncio.Event()

    async def slow_settle(info: dict[str, Any], protocol: int | None) -> None:
        await held.wait()  # the database thread busy with a thousand other nodes

    monkeypatch.setattr(worker, "settle", slow_settle)
    try:
        await asyncio.wait_for(worker.connect(settle=False), 10)
        assert not gate.locked()  # the next node may connect
        assert (await status_cache.aread("n1") or {}).get("state") == "Online"
        assert worker.settle_task is not None and not worker.settle_task.done()
        held.set()
        await asyncio.wait_for(worker.settle_task, 5)
    finally:
        held.set()
        await worker.client.aclose()
