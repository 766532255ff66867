"""Per-key limits against a real Redis: shared across limiters, reserved in blocks,
crash-safe, failing open. Two ``Limiter`` instances with separate connections stand
for two web processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from router import limit_script, limits
from router.errors import V1Error
from router.keys import KeyInfo
from router.limits import Limiter, Ticket

MINUTE = 29_000_000  # some minute of the Unix time


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingRedis(aioredis.Redis):
    """A client that counts every command and pipeline it is asked for."""

    calls = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls += 1
        return await super().execute_command(*args, **options)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().pipeline(*args, **kwargs)


def _key(**limits: int) -> KeyInfo:
    # A fresh id per test, so runs never share counters.
    return KeyInfo(
        id=10**9 + secrets.randbelow(10**9),
        prefix="mbd-test",
        scopes=frozenset({"chat"}),
        model_allowlist=frozenset(),
        expires_at=None,
        **limits,
    )


@pytest.fixture
async def clients() -> AsyncIterator[list[aioredis.Redis]]:
    """Two separate connections to the test Redis, as two web processes would have."""
    made = [aioredis.Redis.from_url(settings.MIRBAD.redis_url) for _ in range(2)]
    yield made
    async for name in made[0].scan_iter("mirbad:rl:*"):
        await made[0].delete(name)
    for client in made:
        await client.aclose()


def _leases(key: KeyInfo) -> str:
    return f"mirbad:rl:{{{key.id}}}:leases"


def _slots(key: KeyInfo) -> str:
    return f"mirbad:rl:{{{key.id}}}:slots"


def _rpm(key: KeyInfo, minute: int = MINUTE) -> str:
    return f"mirbad:rl:{{{key.id}}}:rpm:{minute}"


def _tpm(key: KeyInfo, minute: int = MINUTE) -> str:
    return f"mirbad:rl:{{{key.id}}}:tpm:{minute}"


async def _refused(limiter: Limiter, key: KeyInfo) -> V1Error:
    with pytest.raises(V1Error) as info:
        await limiter.admit(key)
    assert info.value.status == 429 and info.value.code == "rate_limited"
    return info.value


async def test_unlimited_key_makes_no_redis_call() -> None:
    # Port 1: any command would fail, and the counter shows none was even tried.
    client = CountingRedis(host="127.0.0.1", port=1)
    limiter = Limiter(redis=client)
    key = _key()
    for _ in range(100):
        ticket = await limiter.admit(key)
        await limiter.release(ticket, tokens=1000)
    assert client.calls == 0
    # Only an RPM limit: admit is one script call, release needs no round trip.
    live = CountingRedis.from_url(settings.MIRBAD.redis_url)
    try:
        limited = Limiter(redis=live, clock=Clock(MINUTE * 60 + 5))
        key = _key(rpm_limit=10)
        await limited.admit(key)  # the first call may load the script into Redis
        live.calls = 0
        ticket = await limited.admit(key)
        assert live.calls == 1
        await limited.release(ticket, tokens=5)
        assert live.calls == 1
        # The script said the window is full: a client hammering after a 429 costs nothing.
        for _ in range(8):
            await limited.admit(key)
        assert live.calls == 9  # a small limit: one permit per call, exact
        for _ in range(5):
            await _refused(limited, key)
        assert live.calls == 9
    finally:
        await live.delete(_rpm(key))
        await live.aclose()


async def test_rpm_holds_across_two_limiters(clients: list[aioredis.Redis]) -> None:
    clock = Clock(MINUTE * 60 + 10.5)
    limiters = [Limiter(redis=c, clock=clock) for c in clients]
    key = _key(rpm_limit=5)
    results = await asyncio.gather(
        *(limiters[i % 2].admit(key) for i in range(12)), return_exceptions=True
    )
    admitted = [r for r in results if isinstance(r, Ticket)]
    refused = [r for r in results if isinstance(r, V1Error)]
    assert len(admitted) == 5 and len(refused) == 7
    for error in refused:
        assert error.status == 429 and error.code == "rate_limited"
        assert error.retry_after == 50  # to the end of the minute
        assert "5 requests per minute" in error.message and "50 s" in error.message
        assert (b"retry-after", b"50") in error.headers()
    # Refusals consumed nothing: the window holds exactly the admitted requests.
    assert int(await clients[0].get(_rpm(key))) == 5
    assert await clients[0].ttl(_rpm(key)) <= 120

    clock.now = MINUTE * 60 + 59.9
    assert (await _refused(limiters[1], key)).retry_after == 1  # never 0
    clock.now = (MINUTE + 1) * 60  # the next window
    for i in range(5):
        await limiters[i % 2].admit(key)
    await _refused(limiters[0], key)


async def test_tpm_refuses_once_released_tokens_reach_the_limit(
    clients: list[aioredis.Redis],
) -> None:
    clock = Clock(MINUTE * 60 + 30)
    a, b = (Limiter(redis=c, clock=clock) for c in clients)
    key = _key(tpm_limit=100)
    ticket = await a.admit(key)  # reads the window's count: its first request of the window
    await a.release(ticket, tokens=60)  # tallied locally
    ticket = await b.admit(key)  # b does not know a's 60 yet: the documented overshoot
    await b.release(ticket, tokens=50)
    await a.refresh()  # the background round sends the tallies (60, then 110 in all)
    await b.refresh()
    error = await _refused(b, key)
    assert error.retry_after == 30
    assert "100 tokens per minute" in error.message and "110 used" in error.message
    await a.refresh()  # a's next round reads what b sent
    assert "110 used" in (await _refused(a, key)).message
    assert int(await clients[0].get(_tpm(key))) == 110
    clock.now = (MINUTE + 1) * 60 + 1
    await b.release(await b.admit(key), tokens=0)


async def test_tpm_tally_refuses_locally_and_rides_on_block_fetches() -> None:
    client = CountingRedis.from_url(settings.MIRBAD.redis_url)
    limiter = Limiter(redis=client, clock=Clock(MINUTE * 60 + 5))
    key = _key(tpm_limit=100)
    rpm_key = _key(rpm_limit=10, tpm_limit=10**6)
    try:
        await limiter.release(await limiter.admit(key), tokens=150)
        calls = client.calls
        error = await _refused(limiter, key)  # 150 unsent tokens are enough to know
        assert "150 used" in error.message and client.calls == calls
        # A key with a small RPM limit calls the script per admit: tokens go with it.
        await limiter.release(await limiter.admit(rpm_key), tokens=7)
        await limiter.admit(rpm_key)
        assert int(await client.get(_tpm(rpm_key))) == 7
    finally:
        await client.delete(_tpm(key), _tpm(rpm_key), _rpm(rpm_key))
        await client.aclose()


async def test_concurrency_limit(clients: list[aioredis.Redis]) -> None:
    limiter = Limiter(redis=clients[0])
    other = Limiter(redis=clients[1])
    key = _key(concurrency_limit=2)
    results = await asyncio.gather(
        limiter.admit(key), other.admit(key), limiter.admit(key), return_exceptions=True
    )
    tickets = [r for r in results if isinstance(r, Ticket)]
    errors = [r for r in results if isinstance(r, V1Error)]
    assert len(tickets) == 2 and len(errors) == 1
    assert errors[0].retry_after == 1 and "2 requests at once" in errors[0].message
    # Any limiter may release a ticket: it goes back to the books that admitted it.
    await limiter.release(tickets[0], tokens=0)
    for each in (limiter, other):
        await each.refresh()  # the freed slot is given back in the background
    third = await other.admit(key)
    await _refused(limiter, key)
    for ticket in (tickets[1], third):
        await limiter.release(ticket, tokens=0)
    for each in (limiter, other):
        await each.refresh()
    assert await clients[0].zcard(_leases(key)) == 0
    assert await clients[0].hlen(_slots(key)) == 0


async def test_double_release_is_harmless(clients: list[aioredis.Redis]) -> None:
    clock = Clock(MINUTE * 60)
    limiter = Limiter(redis=clients[0], clock=clock)
    key = _key(concurrency_limit=1, tpm_limit=1000)
    ticket = await limiter.admit(key)
    await limiter.release(ticket, tokens=10)
    await limiter.release(ticket, tokens=10)
    assert ticket.released
    await limiter.refresh()
    assert int(await clients[0].get(_tpm(key))) == 10
    holder = await limiter.admit(key)
    await limiter.release(ticket, tokens=10)  # must not free the new holder's slot
    await limiter.refresh()
    await _refused(Limiter(redis=clients[1], clock=clock), key)
    await limiter.release(holder, tokens=0)
    await limiter.refresh()
    assert int(await clients[0].get(_tpm(key))) == 10


async def test_a_dead_process_frees_its_slots_when_the_lease_ends(
    clients: list[aioredis.Redis],
) -> None:
    clock = Clock(MINUTE * 60)
    dying = Limiter(redis=clients[0], clock=clock, lease_seconds=600)
    survivor = Limiter(redis=clients[1], clock=clock, lease_seconds=600)
    key = _key(concurrency_limit=1)
    await dying.admit(key)  # the process "dies": no release ever comes
    await _refused(survivor, key)
    clock.now += 601
    await survivor.release(await survivor.admit(key), tokens=0)

    # A live process renews the lease of a long request, so its slot holds.
    long_request = await survivor.admit(key)
    clock.now += 500
    await survivor.refresh()
    clock.now += 200  # 700 s after admit, 200 s after renewal
    await _refused(dying, key)
    await survivor.release(long_request, tokens=0)
    await survivor.refresh()  # a released ticket is not renewed, nor re-added
    await dying.release(await dying.admit(key), tokens=0)


async def test_background_lease_renewal() -> None:
    client = CountingRedis.from_url(settings.MIRBAD.redis_url)
    limiter = Limiter(redis=client, lease_seconds=0.3)
    key = _key(concurrency_limit=1)
    try:
        limiter.start()
        ticket = await limiter.admit(key)
        await asyncio.sleep(1.5)  # past the lease and the set's own TTL: alive only if renewed
        assert await client.zscore(_leases(key), limiter.lease_id) is not None
        assert int(await client.hget(_slots(key), limiter.lease_id)) == 1
        await _refused(Limiter(redis=client), key)
        await limiter.release(ticket, tokens=0)
        await limiter.stop()
        assert await client.zcard(_leases(key)) == 0
    finally:
        await client.delete(_leases(key), _slots(key))
        await client.aclose()


async def test_refusals_do_not_consume_rpm(clients: list[aioredis.Redis]) -> None:
    limiter = Limiter(redis=clients[0], clock=Clock(MINUTE * 60))
    key = _key(rpm_limit=3, concurrency_limit=1)
    first = await limiter.admit(key)
    for _ in range(5):
        assert "at once" in (await _refused(limiter, key)).message
    await limiter.release(first, tokens=0)
    for _ in range(2):
        await limiter.release(await limiter.admit(key), tokens=0)
    assert "requests per minute" in (await _refused(limiter, key)).message


async def test_redis_down_fails_open_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    client = CountingRedis(host="127.0.0.1", port=1)
    limiter = Limiter(redis=client)
    key = _key(rpm_limit=1, tpm_limit=1, concurrency_limit=1)
    with caplog.at_level(logging.WARNING, logger="mirbad.router.limits"):
        tickets = [await limiter.admit(key) for _ in range(3)]
        for ticket in tickets:
            await limiter.release(ticket, tokens=100)
    warnings = [r for r in caplog.records if r.name == "mirbad.router.limits"]
    assert len(warnings) == 1 and "admitted without limits" in warnings[0].getMessage()
    # After the first error the limiter pauses: the next admits did not wait on Redis.
    assert client.calls <= 2  # the script call, and the background slot give-back
    await client.aclose()


async def test_hung_redis_is_bounded_by_the_timeout() -> None:
    """A Redis that accepts but never answers costs at most ``timeout`` per admit."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = aioredis.Redis(host="127.0.0.1", port=port)
    limiter = Limiter(redis=client, timeout=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await limiter.admit(_key(rpm_limit=1))
    assert loop.time() - started < 1.0
    await client.aclose()
    server.close()


async def test_a_timed_out_admit_gives_its_slot_back(clients: list[aioredis.Redis]) -> None:
    """The script ran but its answer came late: the slot it took must not stay held."""

    async def slow_replies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The suite's Redis is TCP (MIRBAD_REDIS_URL) or ./mirbad test's private one on a
        # unix socket.
        kwargs = clients[0].connection_pool.connection_kwargs
        if "path" in kwargs:
            up_reader, up_writer = await asyncio.open_unix_connection(kwargs["path"])
        else:
            up_reader, up_writer = await asyncio.open_connection(
                kwargs["host"], kwargs.get("port", 6379)
            )

        async def forward(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float):
            while data := await src.read(65536):
                await asyncio.sleep(delay)
                dst.write(data)
                await dst.drain()

        await asyncio.gather(
            forward(reader, up_writer, 0), forward(up_reader, writer, 0.3),
            return_exceptions=True,
        )  # fmt: skip

    server = await asyncio.start_server(slow_replies, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    db = clients[0].connection_pool.connection_kwargs.get("db", 0)
    slow = aioredis.Redis(host="127.0.0.1", port=port, db=db)
    limiter = Limiter(redis=slow, timeout=0.1)
    key = _key(concurrency_limit=1)
    slots = _leases(key)
    try:
        await slow.ping()  # connect (and select the db) before the clock matters
        await clients[0].script_load(limit_script.SYNC)  # so the admit is one EVALSHA
        ticket = await limiter.admit(key)  # times out: fails open
        assert not ticket.holds_slot
        for _ in range(50):
            await asyncio.sleep(0.1)
            if await clients[0].zcard(slots) == 0:
                break
        assert await clients[0].zcard(slots) == 0
        await Limiter(redis=clients[1]).admit(key)  # the key is not blocked for a lease
    finally:
        await slow.aclose()
        server.close()


async def _admit_all(limiter: Limiter, key: KeyInfo, n: int) -> list[Ticket]:
    """``n`` admits at once; the tickets of those admitted."""
    results = await asyncio.gather(*(limiter.admit(key) for _ in range(n)), return_exceptions=True)
    for result in results:
        assert isinstance(result, Ticket | V1Error), result
    return [r for r in results if isinstance(r, Ticket)]


@pytest.mark.parametrize("limit", [100, 1000])
async def test_two_processes_admit_exactly_the_limit(
    clients: list[aioredis.Redis], limit: int
) -> None:
    """Blocks never reserve past the limit, and a process spends its block before 429s."""
    clock = Clock(MINUTE * 60 + 1)
    limiters = [Limiter(redis=c, clock=clock) for c in clients]
    key = _key(rpm_limit=limit)
    admitted = 0
    for i in range(limit + limit // 10):  # one at a time, alternating: blocks grow
        with contextlib.suppress(V1Error):
            await limiters[i % 2].admit(key)
            admitted += 1
    assert admitted == limit
    assert int(await clients[0].get(_rpm(key))) == limit
    # The same with bursts: all waiting admits of a process share one call.
    key = _key(rpm_limit=limit)
    bursts = await asyncio.gather(*(_admit_all(lim, key, limit) for lim in limiters))
    assert sum(len(b) for b in bursts) == limit


async def test_a_big_limit_makes_few_redis_calls() -> None:
    client = CountingRedis.from_url(settings.MIRBAD.redis_url)
    clock = Clock(MINUTE * 60 + 1)
    limiter = Limiter(redis=client, clock=clock)
    key = _key(rpm_limit=10**6, tpm_limit=10**9, concurrency_limit=10**4)
    try:
        for _ in range(1000):
            await limiter.release(await limiter.admit(key), tokens=3)

        async def one() -> None:
            for _ in range(50):
                ticket = await limiter.admit(key)
                await asyncio.sleep(0)
                await limiter.release(ticket, tokens=3)

        await asyncio.gather(*(one() for _ in range(32)))
        assert client.calls <= (1000 + 32 * 50) // 50, client.calls
        await limiter.refresh()
        assert int(await client.get(_tpm(key))) == 3 * (1000 + 32 * 50)
        reserved = int(await client.get(_rpm(key)))
        assert 1000 + 32 * 50 <= reserved <= 1000 + 32 * 50 + limits.MAX_RPM_BLOCK
        await limiter.stop()
        assert int(await client.get(_rpm(key))) == 1000 + 32 * 50  # unused ones given back
        assert await client.zcard(_leases(key)) == 0
    finally:
        await client.delete(_rpm(key), _tpm(key), _leases(key), _slots(key))
        await client.aclose()


async def test_release_never_waits_for_redis() -> None:
    client = CountingRedis.from_url(settings.MIRBAD.redis_url)
    limiter = Limiter(redis=client, clock=Clock(MINUTE * 60 + 1))
    key = _key(rpm_limit=5, tpm_limit=1000, concurrency_limit=1)
    try:
        ticket = await limiter.admit(key)
        calls = client.calls
        await limiter.release(ticket, tokens=12)  # the slot goes back, in the background
        assert client.calls == calls
        await limiter.refresh()
        assert await client.zcard(_leases(key)) == 0
        assert int(await client.get(_tpm(key))) == 12
    finally:
        await client.delete(_rpm(key), _tpm(key), _leases(key), _slots(key))
        await client.aclose()


async def test_idle_slots_go_back_for_other_processes(clients: list[aioredis.Redis]) -> None:
    # A generous timeout: 1,000 admits at once on a loaded CI machine took longer than the
    # default 0.5 s, and a timed-out admit fails open (no slot held), which is another test.
    a, b = (Limiter(redis=c, timeout=10.0) for c in clients)
    key = _key(concurrency_limit=1000)  # blocks of 10: a process may keep 9 idle
    first = await _admit_all(a, key, 1000)
    assert len(first) == 1000
    await _refused(b, key)
    for ticket in first:
        await a.release(ticket, tokens=0)
    await a.refresh()  # what is over two blocks idle went back at once
    assert int(await clients[0].hget(_slots(key), a.lease_id)) == 9
    second = await _admit_all(b, key, 991)
    assert len(second) == 991
    await _refused(b, key)
    await a.refresh()  # a round with no request on a: its idle slots go back too
    assert await clients[0].hget(_slots(key), a.lease_id) is None
    second += await _admit_all(b, key, 9)
    assert len(second) == 1000
    await _refused(b, key)
    for ticket in second:
        await b.release(ticket, tokens=0)
    await b.stop()
    assert await clients[0].zcard(_leases(key)) == 0


async def test_stop_gives_back_everything(clients: list[aioredis.Redis]) -> None:
    clock = Clock(MINUTE * 60 + 1)
    limiter = Limiter(redis=clients[0], clock=clock)
    key = _key(rpm_limit=10_000, tpm_limit=10**6, concurrency_limit=1000)
    limiter.start()
    for _ in range(300):
        await limiter.release(await limiter.admit(key), tokens=3)
    running = await _admit_all(limiter, key, 5)
    assert int(await clients[0].get(_rpm(key))) > 305  # blocks: reserved ahead
    await limiter.stop()
    assert int(await clients[0].get(_rpm(key))) == 305
    assert int(await clients[0].get(_tpm(key))) == 900
    assert await clients[0].zcard(_leases(key)) == 0
    assert await clients[0].hlen(_slots(key)) == 0
    other = Limiter(redis=clients[1], clock=clock)
    assert len(await _admit_all(other, key, 1000)) == 1000  # nothing left held
    for ticket in running:  # requests that outlived stop(): harmless, nothing to free
        await limiter.release(ticket, tokens=0)
    assert await clients[0].hlen(_slots(key)) == 1


async def test_many_requests_at_once_on_a_small_concurrency_limit() -> None:
    """Slots handed back and forth between the requests of one process: give-backs that
    find the slot taken again send nothing, and no admit spins on a finished call."""
    client = CountingRedis.from_url(settings.MIRBAD.redis_url)
    limiter = Limiter(redis=client, clock=Clock(MINUTE * 60 + 1))
    key = _key(rpm_limit=60_000, concurrency_limit=50)
    peak = in_flight = 0

    async def one() -> None:
        nonlocal peak, in_flight
        for _ in range(30):
            ticket = await limiter.admit(key)
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0)
            in_flight -= 1
            await limiter.release(ticket, tokens=0)

    try:
        async with asyncio.timeout(20):
            await asyncio.gather(*(one() for _ in range(32)))
        assert peak == 32
        assert client.calls <= 32 * 30 // 10, client.calls  # slots are reused, not re-asked
        await limiter.stop()
        assert await client.zcard(_leases(key)) == 0
    finally:
        await client.delete(_rpm(key), _leases(key), _slots(key))
        await client.aclose()
