"""The monitor's group writer: many workers' records in one transaction per round trip."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.exceptions
from asgiref.sync import sync_to_async
from redis.asyncio.client import Pipeline

from nodes import status_cache
from nodes.monitor import Monitor
from nodes.status_writer import DirectWriter, GroupWriter
from tests.factories import make_node
from tests.nodes.conftest import stop_workers

pytestmark = pytest.mark.usefixtures("status_redis")


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    client = status_cache.async_client()
    yield client
    await client.aclose()
    status_cache._async_clients.clear()


def record(node_id: str, state: str = "Online") -> status_cache.NodeStatus:
    return {"nodeId": node_id, "state": state, "reasons": [], "lastSeen": None}


async def stored(client: Any, node_id: str) -> dict[str, Any] | None:
    raw = await client.get(f"mirbad:node:{node_id}")
    return json.loads(raw) if raw else None


async def test_three_hundred_writes_go_in_two_transactions(client: Any) -> None:
    """Each worker writing alone made a round trip each through a pool of 32."""
    writer = GroupWriter(max_batch=256)
    await asyncio.gather(*(writer.write(record(f"w{i}")) for i in range(300)))
    assert writer.batches == 2
    assert await client.exists(*(f"mirbad:node:w{i}" for i in range(300))) == 300


async def test_a_nodes_later_record_wins_and_its_extra_commands_go_with_it(client: Any) -> None:
    writer = GroupWriter()

    def also(pipe: Pipeline) -> None:
        pipe.set("mirbad:node:extra-marker", "1", ex=60)

    await asyncio.gather(
        writer.write(record("n1", "Offline")),
        writer.write(record("n1", "Online"), also),
    )
    assert (await stored(client, "n1") or {})["state"] == "Online"
    assert await client.get("mirbad:node:extra-marker") == "1"


async def test_a_record_that_cannot_be_written_fails_alone(client: Any) -> None:
    writer = GroupWriter()

    def broken(pipe: Pipeline) -> None:
        raise ValueError("an odd sample")

    results = await asyncio.gather(
        writer.write(record("good")),
        writer.write(record("bad"), broken),
        return_exceptions=True,
    )
    assert results[0] is None and isinstance(results[1], ValueError)
    assert await stored(client, "good") is not None


async def test_a_failed_transaction_fails_its_writes_and_the_next_goes_through(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = GroupWriter()

    async def refused(self: Pipeline, *args: Any, **kwargs: Any) -> list[Any]:
        raise redis.exceptions.ConnectionError("No connection available.")

    with monkeypatch.context() as patch:
        patch.setattr(Pipeline, "execute", refused)
        results = await asyncio.gather(
            writer.write(record("a")), writer.write(record("b")), return_exceptions=True
        )
    assert all(isinstance(r, redis.exceptions.ConnectionError) for r in results)
    await writer.write(record("a"))
    assert await stored(client, "a") is not None


async def test_a_stopped_workers_queued_write_is_dropped(client: Any) -> None:
    writer = GroupWriter()
    waiting = asyncio.create_task(writer.write(record("gone")))
    await asyncio.sleep(0)  # queued; the writer's task has not run yet
    waiting.cancel()
    await writer.write(record("kept"))
    assert await stored(client, "gone") is None and await stored(client, "kept") is not None


async def test_direct_writer_writes_record_and_extra_commands(client: Any) -> None:
    def also(pipe: Pipeline) -> None:
        pipe.set("mirbad:node:direct-marker", "1", ex=60)

    await DirectWriter().write(record("d1"))
    await DirectWriter().write(record("d2"), also)
    assert await stored(client, "d1") is not None and await stored(client, "d2") is not None
    assert await client.get("mirbad:node:direct-marker") == "1"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "master_identity")
async def test_the_monitors_workers_share_its_writer(client: Any) -> None:
    for node_id in ("n1", "n2"):
        await sync_to_async(make_node)(node_id)
    monitor = Monitor(refresh_interval=60)
    await monitor.refresh()
    try:
        assert {id(w.writer) for w, _ in monitor.workers.values()} == {id(monitor.writer)}
        assert isinstance(monitor.writer, GroupWriter)
    finally:
        await stop_workers(monitor)
