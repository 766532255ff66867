"""nodes.fanout: the monitor's rows go to the fleet in batches, a node page's events only
while a page watches that node, and the consumers hand a batch on as single events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from console.consumers import FleetConsumer, NodeConsumer
from nodes import events, fanout, status_cache
from nodes.telemetry import empty_point
from tests.channels_catcher import Catcher, kinds


def _summary(node_id: str, state: str = "Online", cpu: float | None = None) -> events.NodeSummary:
    return events.NodeSummary(
        nodeId=node_id, state=state, reasons=[], cpuPercent=cpu, memoryPercent=None,
        memoryUsedBytes=None, memoryTotalBytes=None, lastSeen=None, approved=True,
        draining=False, maintenance=False,
    )  # fmt: skip


@pytest.fixture
def watch_key() -> Iterator[None]:
    client = status_cache.sync_client()
    client.delete(fanout.WATCH_KEY)
    yield
    client.delete(fanout.WATCH_KEY)


@pytest.fixture
async def layer_pools() -> AsyncIterator[None]:
    yield
    await get_channel_layer().close_pools()  # its connections belong to this test's loop


@pytest.mark.usefixtures("watch_key", "layer_pools")
async def test_rows_go_to_the_fleet_in_one_batch_the_newest_per_node() -> None:
    batched = fanout.Batched()
    async with Catcher(events.FLEET_GROUP) as fleet:
        for cpu in (1.0, 2.0, 3.0):
            for node_id in ("a", "b"):
                await batched.node_updated(_summary(node_id, cpu=cpu))
        assert await fleet.drain(0.2) == []  # nothing yet: the batch waits its second
        got = await fleet.drain(fanout.FLUSH_SECONDS + 0.5)
    rows = [m["event"]["node"] for m in got]
    assert [(r["nodeId"], r["cpuPercent"]) for r in rows] == [("a", 3.0), ("b", 3.0)]
    assert batched.pending == {}


@pytest.mark.usefixtures("watch_key", "layer_pools")
async def test_a_change_of_state_goes_at_once_after_the_rows_before_it() -> None:
    batched = fanout.Batched()
    async with Catcher(events.FLEET_GROUP) as fleet:
        await batched.node_updated(_summary("a", cpu=5.0))
        started = time.monotonic()
        await batched.node_updated(_summary("b", state="Offline"), urgent=True)
        got = await fleet.drain(0.3)
        took = time.monotonic() - started
    assert [(m["event"]["node"]["nodeId"], m["event"]["node"]["state"]) for m in got] == [
        ("a", "Online"),
        ("b", "Offline"),
    ]
    assert took < fanout.FLUSH_SECONDS  # not held for the batch's second


@pytest.mark.usefixtures("watch_key", "layer_pools")
async def test_a_node_pages_events_are_sent_only_while_a_page_watches_it() -> None:
    batched = fanout.Batched()
    point = empty_point(time.time())
    async with Catcher(events.node_group("a")) as page:
        await batched.node_updated(_summary("a"))
        await batched.node_telemetry("a", point)
        assert await page.drain(0.3) == []  # nobody watches "a": nothing sent to node.a
        await fanout.awatch("a", "some-channel")
        await batched.refresh_watched()
        await batched.node_updated(_summary("a"))
        await batched.node_telemetry("a", point)
        assert kinds(await page.drain(0.3)) == ["node.updated", "node.telemetry"]
        await fanout.aunwatch("a", "some-channel")
        await batched.refresh_watched()
        await batched.node_telemetry("a", point)
        assert await page.drain(0.3) == []
    await batched.close()


@pytest.mark.usefixtures("watch_key")
async def test_an_entry_left_by_a_crashed_web_process_expires() -> None:
    client = status_cache.async_client()
    await client.zadd(fanout.WATCH_KEY, {"gone some-channel": time.time() - 1})
    await fanout.awatch("here", "other-channel")
    assert await fanout.awatched() == {"here"}
    assert await client.zcard(fanout.WATCH_KEY) == 1  # the expired one removed


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("watch_key", "layer_pools")
async def test_the_node_page_registers_and_leaves_and_the_fleet_page_unpacks_batches(
    operator: Any,
) -> None:
    node_page = WebsocketCommunicator(NodeConsumer.as_asgi(), "/ws/nodes/a/")
    node_page.scope["user"] = operator
    node_page.scope["url_route"] = {"kwargs": {"node_id": "a"}}
    connected, _ = await node_page.connect()
    assert connected
    # The consumer registers right after it accepts, so connect() may return first.
    await _watched_becomes({"a"})
    fleet_page = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
    fleet_page.scope["user"] = operator
    connected, _ = await fleet_page.connect()
    assert connected
    await fleet_page.send_json_to({"type": "subscribe", "nodes": ["b"]})
    assert (await fleet_page.receive_json_from(timeout=5))["type"] == "subscribed"

    batched = fanout.Batched()
    for node_id in ("a", "b", "c"):
        await batched.node_updated(_summary(node_id))
    await batched.flush()
    got = await fleet_page.receive_json_from(timeout=5)  # each event alone, filtered
    assert got["type"] == "node.updated" and got["node"]["nodeId"] == "b"
    assert await fleet_page.receive_nothing(timeout=0.3)
    got = await node_page.receive_json_from(timeout=5)  # watched: sent to node.a at once
    assert got["type"] == "node.updated" and got["node"]["nodeId"] == "a"

    await node_page.disconnect()
    await fleet_page.disconnect()
    await _watched_becomes(set())
    await batched.close()


async def _watched_becomes(expected: set[str], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (seen := await fanout.awatched()) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"watched {seen}, not {expected}"
        await asyncio.sleep(0.01)


@pytest.mark.usefixtures("watch_key", "layer_pools")
async def test_the_sending_task_ends_when_idle_and_starts_again() -> None:
    batched = fanout.Batched()
    async with Catcher(events.FLEET_GROUP) as fleet:
        await batched.node_updated(_summary("a"))
        task = batched._task
        assert task is not None
        await asyncio.wait_for(task, 2 * fanout.FLUSH_SECONDS + 2)  # sent, then idle: ended
        await batched.node_updated(_summary("a", cpu=9.0))
        got = await fleet.drain(fanout.FLUSH_SECONDS + 0.5)
    assert [m["event"]["node"]["cpuPercent"] for m in got] == [None, 9.0]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("watch_key", "layer_pools")
async def test_model_rows_are_built_only_while_a_fleet_page_is_open(operator: Any) -> None:
    """The rows come from the database at each instance change: during 5,000 starts with
    no page open they were a third of the monitor's time, for nobody."""
    from nodes.monitor_rows import RowPublisher

    batched = fanout.Batched()
    await batched.refresh_watched()
    rows = RowPublisher("n1", wanted=batched.fleet_watched)
    rows.instance_changed({"instanceId": "m7-p1", "modelId": 7})
    assert not batched.fleet_watched() and rows._models == set()
    page = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
    page.scope["user"] = operator
    connected, _ = await page.connect()
    assert connected
    await batched.refresh_watched()
    rows.instance_changed({"instanceId": "m7-p1", "modelId": 7})
    assert batched.fleet_watched() and rows._models == {7}
    await rows.close()
    await page.disconnect()
    await batched.refresh_watched()
    assert not batched.fleet_watched()
