"""The monitor is the only writer of node statuses and the one that announces them.

Registry changes reach it on the ``monitor`` group; it writes, tells the routers on
``router.invalidate`` and the console on ``fleet``, once per change. Against a real
agent server and the real channel layer (docs/decisions.md D46).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.test import Client

from nodes import events, services, status, status_cache
from nodes.models import Node
from nodes.monitor import Monitor, NodeWorker
from tests.channels_catcher import Catcher, kinds
from tests.factories import make_model, make_node, set_status
from tests.nodes.conftest import Enrolled

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis"),
]


@pytest.fixture
async def layer_pools() -> AsyncIterator[None]:
    yield
    await get_channel_layer().close_pools()  # its connections belong to this test's loop


async def _wait(check: object, seconds: float, what: str) -> float:
    started = time.monotonic()
    while not await check():  # type: ignore[operator]
        assert time.monotonic() - started < seconds, f"{what}: not within {seconds} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def _running(monitor: Monitor) -> AsyncIterator[Monitor]:
    listener = asyncio.create_task(monitor.listen())
    await asyncio.wait_for(monitor.listening.wait(), 5)
    try:
        yield monitor
    finally:
        listener.cancel()
        for worker, task in monitor.workers.values():
            worker.stop.set()
            task.cancel()
        # Bounded: a cancelled channels_redis receive() can hang in its own clean-up (1 in
        # about 10 runs on PostgreSQL here); the test has checked what it came for.
        await asyncio.wait({listener, *(t for _, t in monitor.workers.values())}, timeout=10)


async def _raw_state(node_id: str) -> str | None:
    return (await status_cache.aread(node_id) or {}).get("state")


@pytest.mark.usefixtures("layer_pools")
async def test_a_reconnect_publishes_once(enrolled: Enrolled) -> None:
    await sync_to_async(make_model)("m", enrolled.node)
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        worker.connected = False
        assert worker.last_contact is not None
        await worker.recompute(now=worker.last_contact + 16)  # silent past 15 s
        assert worker.status["state"] == "Offline"
        async with Catcher(events.FLEET_GROUP, events.ROUTER_GROUP) as catcher:
            await worker.connect()
            got = kinds(await catcher.drain())
        assert worker.status["state"] == "Online"
        # It used to announce the change, then announce the snapshot again: twice each.
        assert got.count("node.updated") == 1, got
        assert got.count("model.updated") == 1, got  # the one model placed on the node
        assert got.count("status") == 1, got
    finally:
        await worker.client.aclose()


@pytest.mark.usefixtures("layer_pools")
async def test_a_model_row_event_carries_the_state_over_all_replicas(operator: object) -> None:
    n1, n2 = await sync_to_async(make_node)("n1"), await sync_to_async(make_node)("n2")

    def two_replicas() -> tuple[int, str, str]:
        model = make_model("m", n1)
        model.placements.create(node=n2)
        first, second = (p.instance_id for p in model.placements.order_by("node__node_id"))
        set_status(
            n2, "Online", {second: {"state": "Ready", "restartCount": 1, "modelId": model.pk}}
        )
        return model.pk, first, second

    model_id, on_n1, _ = await sync_to_async(two_replicas)()
    worker = NodeWorker(node=n1, stop=asyncio.Event())
    worker.status.update(state="Online", lastSeen=time.time())
    failed = {
        "instanceId": on_n1,
        "modelId": model_id,
        "state": "Failed",
        "error": "exit 1",
        "restartCount": 2,
        "measured": {"bytes": 5 * 2**30},
    }
    try:
        async with Catcher(events.FLEET_GROUP) as catcher:
            await worker.handle_event("instance", failed)
            got = await catcher.drain()
    finally:
        await worker.client.aclose()
    rows = [m["event"]["model"] for m in got if m["event"]["type"] == "model.updated"]
    # One replica failed, the other is Ready: the model is Ready (on n2), as on the page;
    # it used to say Failed on n1, the state of the replica that changed.
    assert rows == [
        {
            "modelId": model_id,
            "servedName": "m",
            "state": "Ready",
            "nodeId": "n2",
            "error": None,
            "restartCount": 3,
            "measuredBytes": 5 * 2**30,
        }
    ]

    def rendered() -> str:
        client = Client()
        client.force_login(operator)  # type: ignore[arg-type]
        page = client.get("/models/").content.decode()  # the Models page's row
        return page.split(f'data-model="{model_id}"')[1].split("</tr>")[0]

    row = await sync_to_async(rendered)()
    assert "s-Ready" in row and ">n2<" in row and "5.00 GiB" in row and ">3<" in row, row


async def test_a_registry_command_writes_no_status(status_redis: object) -> None:
    node = await sync_to_async(make_node)("n1")
    await sync_to_async(set_status)(node, "Online")
    await sync_to_async(services.set_draining)("n1", True)
    await sync_to_async(services.start_maintenance)("n1", seconds=60)
    await sync_to_async(services.revoke_node)("n1")
    # The record is the monitor's alone; readers see the registry's word at once anyway.
    assert await _raw_state("n1") == "Online"
    revoked = await sync_to_async(Node.objects.get)(node_id="n1")
    assert (await status.aread(revoked))["state"] == "Revoked"


@pytest.mark.usefixtures("layer_pools")
async def test_a_registry_command_reaches_the_monitor(status_redis: object) -> None:
    await sync_to_async(make_node)("n1")
    async with Catcher(events.MONITOR_GROUP) as catcher:
        await sync_to_async(services.set_draining)("n1", True)
        got = await catcher.drain()
    assert got == [{"type": "node.changed", "nodeId": "n1"}]


@pytest.mark.usefixtures("layer_pools")
async def test_a_revoked_node_is_dropped_and_announced_within_a_second(
    enrolled: Enrolled,
) -> None:
    async with _running(Monitor(refresh_interval=60)) as monitor:
        await monitor.refresh()
        await _wait(lambda: _is("n1", "Online"), 10, "n1 Online")
        async with Catcher(events.FLEET_GROUP, events.ROUTER_GROUP) as catcher:
            started = time.monotonic()
            await sync_to_async(services.revoke_node)("n1")
            await _wait(lambda: _is("n1", "Revoked"), 1.0, "the monitor wrote Revoked")
            took = time.monotonic() - started
            got = await catcher.drain()
        assert "n1" not in monitor.workers
        assert {"type": "router.invalidate", "kind": "status", "nodeId": "n1"} in got
        nodes = [m["event"]["node"] for m in got if kinds([m]) == ["node.updated"]]
        states = [n["state"] for n in nodes]
        # One Revoked, and nothing after it. A telemetry update the worker published
        # just before the revocation reached it may come first (seen on a loaded CI
        # machine: one Online event ahead of Revoked).
        assert states.count("Revoked") == 1 and states[-1] == "Revoked", got
        print(f"revoke to Revoked in the status cache: {took * 1000:.0f} ms")


@pytest.mark.usefixtures("layer_pools")
async def test_an_approved_node_is_followed_at_once(enrolled: Enrolled) -> None:
    await sync_to_async(Node.objects.filter(node_id="n1").update)(approved=False)
    async with _running(Monitor(refresh_interval=60)) as monitor:
        await monitor.refresh()
        assert monitor.workers == {}
        await sync_to_async(services.approve_node)("n1")
        # Not at the next refresh (60 s here): the notification starts the worker.
        await _wait(lambda: _is("n1", "Online"), 5, "n1 followed and Online")
        assert "n1" in monitor.workers


async def _is(node_id: str, state: str) -> bool:
    return await _raw_state(node_id) == state


@pytest.mark.django_db
def test_a_node_summary_carries_the_registry_flags_a_row_changes_shape_with() -> None:
    """live.js fetches a row again when these change (docs/decisions.md D68): a drain
    made on another page shows without a reload."""
    from nodes.monitor_rows import node_summary

    node = make_node("n1")
    node.draining = True
    node.save()
    record: status_cache.NodeStatus = {"nodeId": "n1", "state": "Online", "reasons": []}
    summary = node_summary(record, node)
    assert (summary["approved"], summary["draining"], summary["maintenance"]) == (True, True, False)
    gone = node_summary(record)  # a node no longer in the registry
    assert (gone["approved"], gone["draining"], gone["maintenance"]) == (None, None, None)
