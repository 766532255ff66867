"""The fair queue's lean Redis connection (router/queue_wire.py) against the test Redis
and against a server that never answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from router.queue_wire import LeanRedis, QueueWireError, ScriptError, _parse, lean_for

ECHO = "return {ARGV[1], tonumber(ARGV[2]) + 1, {'nested', false}}"


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    made = aioredis.Redis.from_url(settings.MIRBAD.redis_url)
    yield made
    await made.aclose()


async def test_calls_are_pipelined_in_order_in_the_configured_database(
    client: aioredis.Redis,
) -> None:
    lean = lean_for(client, timeout=2.0)
    assert lean is not None
    answers = await asyncio.gather(*(lean.evalsha(ECHO, f"a{i}", i) for i in range(50)))
    assert answers == [[f"a{i}", i + 1, ["nested", None]] for i in range(50)]
    # The same database as the redis-py client (the test URL names one): SELECT was sent.
    await lean.evalsha("redis.call('SET', 'mirbad:q:wire-test', 'x') return 1")
    assert await client.get("mirbad:q:wire-test") == b"x"
    await client.delete("mirbad:q:wire-test")
    lean.close()


async def test_a_flushed_script_cache_is_loaded_again(client: aioredis.Redis) -> None:
    lean = lean_for(client, timeout=2.0)
    assert lean is not None
    assert await lean.evalsha(ECHO, "x", 1) == ["x", 2, ["nested", None]]
    await client.script_flush()
    assert await lean.evalsha(ECHO, "y", 2) == ["y", 3, ["nested", None]]
    with pytest.raises(ScriptError):
        await lean.evalsha("return redis.error_reply('nope')")
    # An error reply leaves the connection usable.
    assert await lean.evalsha(ECHO, "z", 3) == ["z", 4, ["nested", None]]
    lean.close()


async def test_a_silent_server_times_out_and_the_next_call_connects_again() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read(65536)  # takes the command, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lean = LeanRedis(target=("127.0.0.1", port), timeout=0.2)
    try:
        for _ in range(2):
            with pytest.raises(QueueWireError, match="did not answer"):
                await lean.evalsha(ECHO, "a", 1)
        assert len(accepted) == 2  # the timed-out connection was dropped, a new one made
    finally:
        server.close()
        for writer in accepted:
            writer.close()


async def test_nothing_listening_is_a_queue_wire_error() -> None:
    lean = LeanRedis(target=("127.0.0.1", 1), timeout=0.2)
    with pytest.raises(QueueWireError, match="cannot connect"):
        await lean.evalsha(ECHO, "a", 1)


def test_replies_split_anywhere_parse_the_same() -> None:
    raw = b"*3\r\n$2\r\nok\r\n:-7\r\n*2\r\n$-1\r\n+fine\r\n"
    assert _parse(raw, 0) == (["ok", -7, [None, "fine"]], len(raw))
    from router.queue_wire import _Incomplete

    for cut in range(1, len(raw)):
        with pytest.raises(_Incomplete):
            _parse(raw[:cut], 0)


def test_tls_clients_keep_redis_py() -> None:
    assert lean_for(aioredis.Redis.from_url("rediss://127.0.0.1:6380/0"), timeout=1) is None
    unix = lean_for(aioredis.Redis.from_url("unix:///tmp/x.sock?db=3"), timeout=1)
    assert unix is not None and unix._target == "/tmp/x.sock" and unix._db == 3


def test_it_works_on_uvloop_as_the_web_processes_run() -> None:
    """uvloop's transports are not asyncio.Transport instances (found in the e2e test)."""
    import uvloop

    async def main() -> object:
        client = aioredis.Redis.from_url(settings.MIRBAD.redis_url)
        lean = lean_for(client, timeout=2.0)
        assert lean is not None
        try:
            return await lean.evalsha(ECHO, "u", 1)
        finally:
            lean.close()
            await client.aclose()

    assert uvloop.run(main()) == ["u", 2, ["nested", None]]
