"""The fair queue (router/queue.py) against the test Redis: order, bounds, crashes.

Two FairQueue objects on two connections stand for two web processes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from router import queue as queue_mod
from router.errors import V1Error
from router.queue import Entry, FairQueue, Grant
from router.relay import ClientGone


@pytest.fixture
async def clients() -> AsyncIterator[list[aioredis.Redis]]:
    made = [aioredis.Redis.from_url(settings.MIRBAD.redis_url) for _ in range(2)]
    yield made
    async for name in made[0].scan_iter("mirbad:q:*"):
        await made[0].delete(name)
    for client in made:
        await client.aclose()


@pytest.fixture
async def queues(clients: list[aioredis.Redis]) -> AsyncIterator[list[FairQueue]]:
    made = [FairQueue(redis=c, poll_every=0.1) for c in clients]
    yield made
    for queue in made:
        await queue.stop()


def _name() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


def _entry(name: str, key_id: int = 1, *, priority: int = 0, capacity: int = 1,
           replicas: int = 1, bound: int = 100, timeout: float = 10.0) -> Entry:  # fmt: skip
    capacities = [(f"i{r}", capacity) for r in range(replicas)]
    return Entry(name=name, capacities=capacities, priority=priority, key_id=key_id,
                 bound=bound, timeout=timeout)  # fmt: skip


async def _depth(client: aioredis.Redis, name: str) -> int:
    return int(await client.hlen(queue_mod.base(name) + "waiters"))


async def _busy(client: aioredis.Redis, name: str) -> int:
    return sum(int(v) for v in await client.hvals(queue_mod.base(name) + "busy"))


async def _queued(client: aioredis.Redis, name: str, count: int) -> None:
    for _ in range(200):
        if await _depth(client, name) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} requests never queued")


async def test_a_free_slot_is_granted_at_once_and_released(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    name = _name()
    grant = await queues[0].acquire(_entry(name))
    assert grant is not None and grant.instance_id == "i0" and grant.waited < 1
    assert await _busy(clients[0], name) == 1
    queues[0].release(grant, _entry(name).capacities)
    await queues[0].settle()
    assert await _busy(clients[0], name) == 0
    assert queue_mod.last_used(name) is not None


async def test_order_on_a_recorded_arrival_pattern(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    """Priority first, then round robin across keys, then arrival, across two processes."""
    name = _name()
    holder = await queues[0].acquire(_entry(name, key_id=99))
    assert holder is not None
    # key 1 sends five, key 2 two, key 3 (priority 1) one, then key 1 one more;
    # they alternate between the two processes.
    pattern = [(1, 0)] * 5 + [(2, 0)] * 2 + [(3, 1)] + [(1, 0)]
    order: list[str] = []
    tasks: list[asyncio.Task[Any]] = []
    labels: list[str] = []
    counts: dict[int, int] = {}
    for index, (key_id, priority) in enumerate(pattern):
        counts[key_id] = counts.get(key_id, 0) + 1
        label = f"k{key_id}#{counts[key_id]}"
        labels.append(label)
        queue = queues[index % 2]
        entry = _entry(name, key_id, priority=priority)

        async def wait(queue: FairQueue = queue, entry: Entry = entry, label: str = label) -> None:
            grant = await queue.acquire(entry)
            assert grant is not None
            order.append(label)
            await asyncio.sleep(0.02)
            queue.release(grant, entry.capacities)

        tasks.append(asyncio.ensure_future(wait()))
        await _queued(clients[0], name, index + 1)  # arrival order is fixed
    queues[0].release(holder, _entry(name).capacities)
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert order == ["k3#1", "k1#1", "k2#1", "k1#2", "k2#2", "k1#3", "k1#4", "k1#5", "k1#6"]


async def test_slots_never_exceed_capacity_across_two_processes(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    name = _name()
    held = 0
    most = 0

    async def one(i: int) -> None:
        nonlocal held, most
        entry = _entry(name, key_id=i % 3, capacity=2, replicas=2)
        grant = await queues[i % 2].acquire(entry)
        assert grant is not None
        held += 1
        most = max(most, held)
        await asyncio.sleep(0.01)
        held -= 1
        queues[i % 2].release(grant, entry.capacities)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 30)
    await asyncio.gather(*(q.settle() for q in queues))
    assert most == 4  # two replicas of two slots, all used, never more
    assert await _busy(clients[0], name) == 0 and await _depth(clients[0], name) == 0


async def test_a_full_queue_refuses_at_once_with_retry_after(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    name = _name()
    entry = _entry(name, bound=2)
    holder = await queues[0].acquire(entry)

    async def wait() -> None:
        grant = await queues[1].acquire(entry)
        queues[1].release(grant, entry.capacities)

    waiting = [asyncio.ensure_future(wait()) for _ in range(2)]
    await _queued(clients[0], name, 2)
    with pytest.raises(V1Error) as info:
        await queues[0].acquire(entry)
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert info.value.retry_after is not None and info.value.retry_after >= 1
    queues[0].release(holder, entry.capacities)
    await asyncio.wait_for(asyncio.gather(*waiting), 10)


async def test_a_wait_past_the_timeout_is_429_queue_timeout_and_leaves_the_line(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    name = _name()
    holder = await queues[0].acquire(_entry(name))
    with pytest.raises(V1Error) as info:
        await queues[1].acquire(_entry(name, timeout=0.3))
    assert info.value.code == "queue_timeout" and info.value.status == 429
    assert info.value.retry_after is not None and info.value.retry_after >= 1
    assert await _depth(clients[0], name) == 0
    queues[0].release(holder, _entry(name).capacities)


async def test_a_client_that_disconnects_while_queued_leaves_the_line(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    name = _name()
    holder = await queues[0].acquire(_entry(name))
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    waiter = asyncio.ensure_future(queues[1].acquire(_entry(name), receive=receive))
    await _queued(clients[0], name, 1)
    gone.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(waiter, 5)
    assert await _depth(clients[0], name) == 0
    # The slot freed later goes to nobody: it is free for the next request at once.
    queues[0].release(holder, _entry(name).capacities)
    await queues[0].settle()
    assert await _busy(clients[0], name) == 0


async def test_a_cancelled_waiter_leaves_no_place_and_no_slot(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    name = _name()
    holder = await queues[0].acquire(_entry(name))
    waiter = asyncio.ensure_future(queues[1].acquire(_entry(name)))
    await _queued(clients[0], name, 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await _depth(clients[0], name) == 0
    queues[0].release(holder, _entry(name).capacities)
    await queues[0].settle()
    assert await _busy(clients[0], name) == 0


async def test_a_dead_process_loses_its_slots_when_its_lease_lapses(
    clients: list[aioredis.Redis],
) -> None:
    name = _name()
    dead = FairQueue(redis=clients[0], lease_seconds=0.5)
    live = FairQueue(redis=clients[1], poll_every=0.1)
    try:
        grant = await dead.acquire(_entry(name))
        assert grant is not None
        if dead._renewer is not None:
            dead._renewer.cancel()  # the process "dies": no release, no renewal
        started = asyncio.get_running_loop().time()
        other = await asyncio.wait_for(live.acquire(_entry(name)), 10)
        assert other is not None and other.instance_id == "i0"
        assert asyncio.get_running_loop().time() - started >= 0.3
        live.release(other, _entry(name).capacities)
        await live.settle()
        assert await _busy(clients[0], name) == 0
    finally:
        await live.stop()


async def test_a_replica_that_becomes_ready_takes_waiters_without_a_release(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    name = _name()
    one = _entry(name)
    holder = await queues[0].acquire(one)
    two = _entry(name, replicas=2)

    async def now() -> list[tuple[str, int]]:
        return list(two.capacities)

    grant = await asyncio.wait_for(queues[1].acquire(one, capacities_now=now), 5)
    assert isinstance(grant, Grant) and grant.instance_id == "i1" and grant.waited > 0
    queues[0].release(holder, one.capacities)
    queues[1].release(grant, two.capacities)


async def test_redis_away_fails_open() -> None:
    broken = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    queue = FairQueue(redis=broken)
    try:
        assert await queue.acquire(_entry(_name())) is None
    finally:
        await queue.stop()
        await broken.aclose()


async def test_full_says_when_the_line_holds_its_bound(
    queues: list[FairQueue], clients: list[aioredis.Redis]
) -> None:
    """What an alias asks before it sends a request to a target (Serving._can_take)."""
    name = _name()
    entry = _entry(name, bound=1)
    holder = await queues[0].acquire(entry)
    assert not await queues[0].full(name, 1)  # busy, but nobody waits
    waiter = asyncio.ensure_future(queues[1].acquire(entry))
    await _queued(clients[0], name, 1)
    assert await queues[0].full(name, 1)
    assert not await queues[0].full(name, 2)
    queues[0].release(holder, entry.capacities)
    grant = await asyncio.wait_for(waiter, 5)
    queues[1].release(grant, entry.capacities)


async def test_after_a_failure_no_request_waits_on_redis_until_a_probe_answers() -> None:
    """A stalled Redis costs one timeout, then requests are served without the queue."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read(65536)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    stalled = aioredis.Redis(host="127.0.0.1", port=server.sockets[0].getsockname()[1])
    queue = FairQueue(redis=stalled, call_timeout=0.2)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        assert await queue.acquire(_entry(_name())) is None
        assert loop.time() - started >= 0.2  # the one timeout
        started = loop.time()
        for _ in range(5):
            assert await queue.acquire(_entry(_name())) is None
        assert loop.time() - started < 0.1  # none waited
        assert not queue.usable()
    finally:
        server.close()
        for writer in accepted:
            writer.close()
        await queue.stop()
        await stalled.aclose()
