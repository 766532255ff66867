"""protocol.wire's WirePool against real servers on 127.0.0.1: aiohttp apps, and raw
asyncio servers where the exact bytes on the wire matter."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography.x509.oid import ExtendedKeyUsageOID
from multidict import CIMultiDict

from protocol.errors import BadResponse, ConnectFailed, Disconnected, ReadTimeout, WireError
from protocol.wire import MAX_RESPONSE_HEADERS, WirePool
from tests.agent.agent_support import issue, make_ca

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK_KEEPALIVE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


# -- servers ----------------------------------------------------------------------------


@dataclass
class RawServer:
    port: int = 0
    accepted: int = 0
    finished: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def settle(self, timeout: float = 1.0) -> None:
        """Wait for the handlers of the connections accepted so far to end."""
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[RawServer]:
    """An asyncio server running ``handler`` per connection; cancels them on exit."""
    info = RawServer()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        info.tasks.add(task)
        try:
            await handler(reader, writer)
        # Cancelled at teardown, or the client went away: both are the test's business,
        # and a cancelled start_server task would otherwise be logged as an error.
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            info.finished += 1
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    info.port = server.sockets[0].getsockname()[1]
    try:
        yield info
    finally:
        server.close()
        for task in info.tasks:
            task.cancel()
        await asyncio.gather(*info.tasks, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def web_server(
    app: web.Application, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def keepalive_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request on the connection with a keep-alive ``ok``."""
    while True:
        try:
            await read_head(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(OK_KEEPALIVE)
        await writer.drain()


async def eventually(predicate: Callable[[], bool], timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def echo_app() -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "method": request.method,
                "rawPath": request.raw_path,
                "headers": list(request.headers.items()),
                # A digest, not the bytes: the answer stays small whatever the body.
                "sha256": hashlib.sha256(body).hexdigest(),
                "length": len(body),
                "port": request.transport.get_extra_info("peername")[1],  # type: ignore[union-attr]  # open while its handler runs
            },
            headers=CIMultiDict([("X-Rep", "a"), ("X-Rep", "b")]),
        )

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def header_values(seen: dict[str, Any], name: str) -> list[str]:
    """The values of one header as the echo app received it (repeats kept)."""
    return [v for k, v in seen["headers"] if k.lower() == name.lower()]


@pytest.fixture
async def make_pool() -> AsyncIterator[Callable[..., WirePool]]:
    made: list[WirePool] = []

    def make(**options: float) -> WirePool:
        pool = WirePool(**{"connect_timeout": 2.0, **options})  # type: ignore[arg-type]  # float options only; mypy checks each parameter
        made.append(pool)
        return pool

    yield make
    for pool in made:
        await pool.close()


@pytest.fixture
def pool(make_pool: Callable[..., WirePool]) -> WirePool:
    return make_pool()


# -- plain answers ----------------------------------------------------------------------


async def test_get_with_content_length_answer(pool: WirePool) -> None:
    async with web_server(echo_app()) as port:
        target = "/echo/a%20b?x=1&y=%2F"
        response = await pool.request(
            "GET", "127.0.0.1", port, target, headers=[("X-Test", "yes"), ("Accept", "*/*")]
        )
        assert response.status == 200
        assert response.header("content-type") == "application/json; charset=utf-8"
        assert response.header("x-rep") == "a, b"
        assert (b"X-Rep", b"a") in response.raw_headers
        assert (b"X-Rep", b"b") in response.raw_headers
        body = await response.read()
        assert response.content_length == len(body)
        assert response.at_eof()
        seen = json.loads(body)
        assert seen["method"] == "GET"
        assert seen["rawPath"] == target
        assert header_values(seen, "Host") == [f"127.0.0.1:{port}"]
        assert header_values(seen, "X-Test") == ["yes"]
        assert header_values(seen, "Accept") == ["*/*"]
        assert header_values(seen, "Content-Length") == []
        assert header_values(seen, "Transfer-Encoding") == []
        assert seen["length"] == 0


async def test_post_bytes_body_carries_content_length(pool: WirePool) -> None:
    async with web_server(echo_app()) as port:
        small = b"hello\x00world\r\n"
        large = os.urandom(200_000)  # above the one-write limit: head and body go apart
        for body in (small, large):
            response = await pool.request(
                "POST", "127.0.0.1", port, "/p", headers=[("Content-Type", "x/y")], body=body
            )
            assert response.status == 200
            seen = json.loads(await response.read())
            assert seen["method"] == "POST"
            assert seen["sha256"] == hashlib.sha256(body).hexdigest()
            assert seen["length"] == len(body)
            assert header_values(seen, "Content-Length") == [str(len(body))]
            assert header_values(seen, "Content-Type") == ["x/y"]
            assert header_values(seen, "Transfer-Encoding") == []
        response = await pool.request("POST", "127.0.0.1", port, "/empty")
        seen = json.loads(await response.read())
        assert header_values(seen, "Content-Length") == ["0"]


async def test_chunked_answer_streams_pieces_as_they_arrive(pool: WirePool) -> None:
    first_seen = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        # The rest only once the client holds the first piece: no buffering to the end.
        await asyncio.wait_for(first_seen.wait(), 5)
        writer.write(b"6\r\nsecond\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"5\r\nthird\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert response.header("transfer-encoding") == "chunked"
        assert response.content_length is None
        pieces: list[bytes] = []
        async for chunk in response.iter_chunks():
            pieces.append(chunk)
            first_seen.set()
        assert pieces[0] == b"first"
        assert b"".join(pieces) == b"firstsecondthird"
        assert response.at_eof()
        assert pool.connections == 1  # chunked framing ends the answer: kept alive


async def test_take_buffered_hands_over_what_came_with_the_headers(pool: WirePool) -> None:
    more = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        # Headers and the first piece in one write, as llama-server sends an SSE start.
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.wait_for(more.wait(), 5)
        writer.write(b"4\r\nnext\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert response.take_buffered() == b"first"  # no wait: it is already here
        assert response.take_buffered() == b""  # nothing more yet, and still no wait
        more.set()
        assert b"".join([c async for c in response.iter_chunks()]) == b"next"
        assert response.at_eof()


async def test_pipe_hands_each_read_to_the_sink_inside_the_read(pool: WirePool) -> None:
    """pipe(): a lone chunk reaches the sink at once, the chunks of one read in one call,
    each call made from the connection's read callback (no task runs between the
    arrival and the sink), and pipe() returns when the answer ends."""
    go = asyncio.Event()
    got_lone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(go.wait(), 5)
        writer.write(b"4\r\nlone\r\n")
        await writer.drain()
        await asyncio.wait_for(got_lone.wait(), 5)  # it did not wait for more
        # Three chunks in one write: one read on the other side, one sink call.
        writer.write(b"1\r\na\r\n1\r\nb\r\n1\r\nc\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    calls: list[tuple[bytes, asyncio.Task[Any] | None]] = []

    def sink(data: bytes) -> None:
        calls.append((data, asyncio.current_task()))
        got_lone.set()

    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert response.take_buffered() == b""
        piping = asyncio.create_task(response.pipe(sink))
        go.set()
        await asyncio.wait_for(piping, 5)
        assert [data for data, _ in calls] == [b"lone", b"abc"]
        assert [task for _, task in calls] == [None, None]  # from the read callback itself
        assert response.at_eof()
        assert pool.connections == 1  # the answer ended cleanly: kept alive


async def test_pipe_raises_the_read_timeout_of_a_silent_server(pool: WirePool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nsome\r\n")
        await writer.drain()
        await asyncio.sleep(10)

    got: list[bytes] = []
    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=0.3)
        started = time.monotonic()
        with pytest.raises(ReadTimeout):
            await response.pipe(got.append)
        assert time.monotonic() - started < 2
        assert b"".join(got) in (b"", b"some")


async def test_pipe_hold_stops_reading_until_released(pool: WirePool) -> None:
    """hold(True) is the sink's back-pressure: the server's writes stall while it holds,
    nothing is lost, and the pause does not count as the server's silence."""
    total = 16 * 1024 * 1024
    sent = 0
    piece = b"x" * 65536

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        while sent < total:
            writer.write(piece)
            sent += len(piece)
            await writer.drain()
        await reader.read()

    got = 0
    held = False
    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=0.5)

        def sink(data: bytes) -> None:
            nonlocal got, held
            got += len(data)
            if got >= 1024 * 1024 and not held:
                held = True
                response.hold(True)

        piping = asyncio.create_task(response.pipe(sink))
        await asyncio.sleep(1.0)  # twice the read timeout, held all along
        assert held and not piping.done()
        held_at = sent
        assert held_at < total // 2, held_at  # the server stalled: reading stopped
        await asyncio.sleep(0.2)
        assert sent == held_at
        response.hold(False)
        await asyncio.wait_for(piping, 10)
        assert got == total


async def test_answer_until_close_is_read_whole_and_not_reused(pool: WirePool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nno length, ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"ends at EOF")
        await writer.drain()

    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert response.content_length is None
        assert await response.read() == b"no length, ends at EOF"
        assert response.at_eof()
        assert pool.connections == 0
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert await response.read() == b"no length, ends at EOF"
        assert server.accepted == 2


async def test_head_answer_has_no_body_despite_content_length(pool: WirePool) -> None:
    request_heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_heads.append(await read_head(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nContent-Type: text/plain\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as server:
        response = await pool.request("HEAD", "127.0.0.1", server.port, "/x", read_timeout=2.0)
        assert response.status == 200
        assert response.content_length == 10
        assert response.header("content-type") == "text/plain"
        assert await asyncio.wait_for(response.read(), 1.0) == b""
        assert request_heads[0].startswith(b"HEAD /x HTTP/1.1\r\n")
        assert b"content-length" not in request_heads[0].lower()


# -- keep-alive -------------------------------------------------------------------------


async def test_keepalive_reuses_one_connection(pool: WirePool) -> None:
    async with web_server(echo_app()) as port:
        first = json.loads(await (await pool.request("GET", "127.0.0.1", port, "/1")).read())
        second = json.loads(await (await pool.request("GET", "127.0.0.1", port, "/2")).read())
        assert first["port"] == second["port"]
        assert pool.connections == 1


async def test_idle_connection_closed_by_server_is_not_used(pool: WirePool) -> None:
    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(OK_KEEPALIVE)  # keep-alive by HTTP/1.1 default, then closed anyway
        await writer.drain()

    async with raw_server(answer_once) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert await response.read() == b"ok"
        await eventually(lambda: pool.connections == 0)
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert await response.read() == b"ok"
        assert server.accepted == 2


async def test_idle_connection_older_than_keepalive_is_not_reused(
    make_pool: Callable[..., WirePool],
) -> None:
    pool = make_pool(keepalive_seconds=0.05)
    async with raw_server(keepalive_ok) as server:
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/")).read() == b"ok"
        assert pool.connections == 1
        await asyncio.sleep(0.1)
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/")).read() == b"ok"
        assert server.accepted == 2
        assert pool.connections == 1
        await eventually(lambda: server.finished == 1)  # the stale one was closed


# -- reused connections the server closes -------------------------------------------------


def answer_first_then(
    second: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    later: Handler = keepalive_ok,
) -> tuple[Handler, list[bytes]]:
    """A handler whose first connection answers one request keep-alive, then meets the
    next with ``second``; every later connection runs ``later``. Returns the handler and
    the request heads (with small bodies) the later connections received."""
    seen: list[bytes] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:
            await read_head(reader)
            writer.write(OK_KEEPALIVE)
            await writer.drain()
            await second(reader, writer)
            return

        async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await read_head(reader) + await reader.read(4))
            writer.write(OK_KEEPALIVE)
            await writer.drain()
            await later(reader, writer)

        await recording(reader, writer)

    return handler, seen


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a server that aborts does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.mark.parametrize("how", ["eof", "reset"])
async def test_reused_connection_closed_as_the_request_arrives_is_retried_fresh(
    pool: WirePool, how: str
) -> None:
    async def hang_up_on_next(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)  # the request is written; the server closes unanswered
        if how == "reset":
            reset(writer)

    handler, seen = answer_first_then(hang_up_on_next)
    async with raw_server(handler) as server:
        first = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert await first.read() == b"ok"
        assert pool.connections == 1  # kept: the next request reuses it
        response = await pool.request(
            "POST", "127.0.0.1", server.port, "/again", body=b"body", read_timeout=2.0
        )
        assert await response.read() == b"ok"
        assert server.accepted == 2
        assert pool.retries == 1
        # The retry carried the same request, body included, on the fresh connection.
        assert seen[0].startswith(b"POST /again HTTP/1.1\r\n")
        assert b"Content-Length: 4\r\n" in seen[0] and seen[0].endswith(b"\r\n\r\nbody")


async def test_large_in_memory_body_is_retried_too(pool: WirePool) -> None:
    payload = os.urandom(300_000)  # above the one-write limit: head and body go apart
    received: list[bytes] = []

    async def hang_up_on_next(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)

    async def take_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readexactly(len(payload) - 4))  # 4 read by the recorder

    handler, seen = answer_first_then(hang_up_on_next, later=take_body)
    async with raw_server(handler) as server:
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/")).read() == b"ok"
        response = await pool.request(
            "PUT", "127.0.0.1", server.port, "/big", body=payload, read_timeout=2.0
        )
        assert await response.read() == b"ok"
        await server.settle()
        assert seen[0].endswith(payload[:4]) and received == [payload[4:]]
        assert server.accepted == 2


async def test_a_fresh_connection_closed_before_answering_is_not_retried(
    pool: WirePool,
) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)

    async with raw_server(hang_up) as server:
        with pytest.raises(Disconnected, match="before answering"):
            await pool.request("POST", "127.0.0.1", server.port, "/", body=b"x", read_timeout=2.0)
        assert server.accepted == 1
        assert pool.retries == 0


async def test_a_retry_is_made_once_and_its_failure_surfaces(pool: WirePool) -> None:
    connections = 0

    async def first_answers_then_all_hang_up(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:
            await read_head(reader)
            writer.write(OK_KEEPALIVE)
            await writer.drain()
        await read_head(reader)  # then every request meets a close

    async with raw_server(first_answers_then_all_hang_up) as server:
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/")).read() == b"ok"
        with pytest.raises(Disconnected, match="before answering"):
            await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert server.accepted == 2  # the reused one and one fresh: no third try
        assert pool.retries == 1
        assert pool.connections == 0


async def test_a_failure_after_answer_bytes_is_not_retried(pool: WirePool) -> None:
    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-")  # the server began answering
        await writer.drain()

    handler, _ = answer_first_then(half_answer)
    async with raw_server(handler) as server:
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/")).read() == b"ok"
        with pytest.raises(Disconnected, match="before answering"):
            await pool.request("POST", "127.0.0.1", server.port, "/", body=b"x", read_timeout=2.0)
        assert server.accepted == 1
        assert pool.retries == 0


async def test_a_streamed_body_is_not_sent_twice(pool: WirePool) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)

    async def body() -> AsyncIterator[bytes]:
        yield b"once"  # consumed as it is sent: there is nothing left to send again

    handler, _ = answer_first_then(hang_up)
    async with raw_server(handler) as server:
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/")).read() == b"ok"
        with pytest.raises(Disconnected):
            await pool.request("POST", "127.0.0.1", server.port, "/", body=body(), read_timeout=2.0)
        assert server.accepted == 1
        assert pool.retries == 0


async def test_a_kept_connection_whose_end_arrived_unread_is_not_picked(pool: WirePool) -> None:
    """The server's FIN is in the socket but the loop has not run to read it: the pool
    must see it when it picks the connection. A streamed body (never retried) proves the
    request went on a fresh connection from the start."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    port = listener.getsockname()[1]
    close_first = threading.Event()
    accepted: list[socket.socket] = []
    second_request = bytearray()

    def serve() -> None:
        first, _ = listener.accept()
        accepted.append(first)
        _recv_until(first, b"\r\n\r\n")
        first.sendall(OK_KEEPALIVE)
        close_first.wait(5)
        first.close()
        second, _ = listener.accept()
        accepted.append(second)
        second_request.extend(_recv_until(second, b"0\r\n\r\n"))
        second.sendall(OK_KEEPALIVE)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def body() -> AsyncIterator[bytes]:
        yield b"streamed"

    try:
        assert await (await pool.request("GET", "127.0.0.1", port, "/")).read() == b"ok"
        assert pool.connections == 1
        close_first.set()
        time.sleep(0.2)  # blocking on purpose: the FIN arrives, the loop does not run
        response = await pool.request("POST", "127.0.0.1", port, "/", body=body(), read_timeout=2.0)
        assert await response.read() == b"ok"
        assert len(accepted) == 2
        assert b"streamed" in second_request
        assert pool.retries == 0
    finally:
        close_first.set()
        thread.join(5)
        for sock in accepted:
            sock.close()
        listener.close()


def _recv_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


async def test_max_idle_caps_the_connections_kept_for_one_server(pool: WirePool) -> None:
    release = asyncio.Event()

    async def slow_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_head(reader)
            except asyncio.IncompleteReadError:
                return
            await release.wait()
            writer.write(OK_KEEPALIVE)
            await writer.drain()

    async with raw_server(slow_ok) as server:
        pending = [
            asyncio.ensure_future(
                pool.request("GET", "127.0.0.1", server.port, "/", max_idle=1, read_timeout=2.0)
            )
            for _ in range(3)
        ]
        await eventually(lambda: server.accepted == 3)  # three at once: three connections
        release.set()
        for response in await asyncio.gather(*pending):
            assert await response.read() == b"ok"
        assert pool.connections == 1  # one kept, the other two closed
        await eventually(lambda: server.finished == 2)
        # The one kept is reused; the cap holds for later answers too.
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/", max_idle=1)).read()
        assert server.accepted == 3


# -- failures ---------------------------------------------------------------------------


async def test_closed_port_is_connect_failed(pool: WirePool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectFailed):
        await pool.request("GET", "127.0.0.1", port, "/")
    assert pool.connections == 0


async def test_connect_timeout_covers_tls_handshake(
    make_pool: Callable[..., WirePool],
) -> None:
    pool = make_pool(connect_timeout=0.2)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    context = ssl.create_default_context()
    async with raw_server(silent) as server:
        started = time.monotonic()
        with pytest.raises(ConnectFailed):
            await pool.request("GET", "127.0.0.1", server.port, "/", ssl_context=context)
        assert time.monotonic() - started < 1.5
    assert pool.connections == 0


async def test_no_answer_is_read_timeout(pool: WirePool) -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await asyncio.sleep(10)

    async with raw_server(mute) as server:
        started = time.monotonic()
        with pytest.raises(ReadTimeout) as caught:
            await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=0.2)
        assert 0.15 <= time.monotonic() - started < 1.5
        assert isinstance(caught.value, TimeoutError)
        await eventually(lambda: pool.connections == 0)


@pytest.mark.parametrize("reused", [False, True])
async def test_a_server_that_stops_reading_the_body_is_read_timeout(
    pool: WirePool, reused: bool
) -> None:
    """A peer that takes the head and then reads nothing (a partition, a stopped agent)
    leaves the body unsent: the read timeout ends it as a ReadTimeout, not as a closed
    connection, which on a reused connection would be sent again (D39)."""
    served = 0

    async def answer_once_then_stop_reading(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal served
        if reused and served == 0:
            served += 1
            await read_head(reader)
            writer.write(OK_KEEPALIVE)
            await writer.drain()
        await read_head(reader)
        await asyncio.sleep(10)  # the body stays in the kernel's buffers, then ours

    async with raw_server(answer_once_then_stop_reading) as server:
        if reused:
            response = await pool.request("GET", "127.0.0.1", server.port, "/")
            assert await response.read() == b"ok"
        body = b"x" * (48 * 1024 * 1024)  # more than loopback's socket buffers hold
        started = time.monotonic()
        with pytest.raises(ReadTimeout):
            await pool.request("POST", "127.0.0.1", server.port, "/", body=body, read_timeout=0.3)
        assert time.monotonic() - started < 3
        assert pool.retries == 0 and server.accepted == 1
        await eventually(lambda: pool.connections == 0)


async def test_body_stall_is_read_timeout_after_first_bytes(pool: WirePool) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(10)

    async with raw_server(stall) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=0.2)
        pieces: list[bytes] = []
        with pytest.raises(ReadTimeout):
            async for chunk in response.iter_chunks():
                pieces.append(chunk)
        assert pieces == [b"abc"]
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=0.2)
        with pytest.raises(ReadTimeout):
            await response.read()
        await eventually(lambda: pool.connections == 0)


async def test_read_timeout_is_idle_time_not_total_time(pool: WirePool) -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        await writer.drain()
        for byte in b"12345":
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))
            await writer.drain()
        await reader.read()

    async with raw_server(trickle) as server:
        started = time.monotonic()
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=0.3)
        assert await response.read() == b"12345"
        assert time.monotonic() - started >= 0.45  # longer than the timeout in total


async def test_close_before_answer_is_disconnected(pool: WirePool) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)

    async with raw_server(hang_up) as server:
        with pytest.raises(Disconnected):
            await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        await eventually(lambda: pool.connections == 0)


async def test_close_mid_content_length_body_is_disconnected(pool: WirePool) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()

    async with raw_server(cut) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert response.status == 200
        with pytest.raises(Disconnected):
            await response.read()
        assert not response.at_eof()
        assert pool.connections == 0


async def test_close_mid_chunked_body_is_disconnected(pool: WirePool) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()

    async with raw_server(cut) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        pieces: list[bytes] = []
        with pytest.raises(Disconnected):
            async for chunk in response.iter_chunks():
                pieces.append(chunk)
        assert pieces == [b"abc"]


async def test_garbage_answer_is_bad_response(pool: WirePool) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"NOT HTTP\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(garbage) as server:
        with pytest.raises(BadResponse):
            await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        await eventually(lambda: pool.connections == 0)


def answer_with(raw: bytes) -> Handler:
    """A server that answers every request on a connection with ``raw``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_head(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(raw)
            await writer.drain()

    return handler


async def test_header_values_lose_their_trailing_whitespace(pool: WirePool) -> None:
    """Found by the property tests (test_wire_props.py): httptools keeps a value's
    trailing spaces and tabs, which are not part of it, so an agent error code
    followed by a space did not read as that code."""
    raw = (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"x-mirbad-agent-error: \tmodel_not_running \t\r\nContent-Length: 2\r\n\r\nno"
    )
    async with raw_server(answer_with(raw)) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/")
        assert response.raw_headers[0] == (b"x-mirbad-agent-error", b"model_not_running")
        assert response.header("x-mirbad-agent-error") == "model_not_running"
        assert await response.read() == b"no"


async def test_trailers_are_not_added_to_the_headers(pool: WirePool) -> None:
    """Found by the property tests: a chunked answer's trailer fields were appended to
    ``raw_headers``, so an answer the router reads whole before sending its head gave
    its client the trailers as headers."""
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\nSet-Cookie: planted=1\r\nX-Trailer: t\r\n\r\n"
    )
    async with raw_server(answer_with(raw)) as server:
        for _ in range(2):  # and the kept connection parses the next answer cleanly
            response = await pool.request("GET", "127.0.0.1", server.port, "/")
            assert await response.read() == b"ok"
            assert response.raw_headers == [(b"Transfer-Encoding", b"chunked")]
            assert "set-cookie" not in response.headers
        assert server.accepted == 1


@pytest.mark.parametrize(
    "coding", [b"gzip", b"chunked, gzip", b"gzip, chunked", b"identity", b"chunked, chunked"]
)
async def test_a_transfer_coding_other_than_chunked_is_bad_response(
    pool: WirePool, coding: bytes
) -> None:
    """Found by the property tests: ``Transfer-Encoding: gzip`` made the parser read the
    body to the close still gzipped, and the router drops Transfer-Encoding as
    hop-by-hop, so its client got bytes it could not know to decode."""

    async def encoded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\n\r\n\x1f\x8b...")
        await writer.drain()
        writer.close()

    async with raw_server(encoded) as server:
        with pytest.raises(BadResponse, match="transfer coding"):
            response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2)
            await response.read()
        await eventually(lambda: pool.connections == 0)


async def test_header_with_line_break_is_refused_and_nothing_sent(pool: WirePool) -> None:
    received = bytearray()

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read())

    async with raw_server(record) as server:
        for name, value in (("X-Evil", "a\r\nInjected: 1"), ("X-Evil", "a\nb"), ("X\r", "v")):
            with pytest.raises(ValueError, match="line break"):
                await pool.request("GET", "127.0.0.1", server.port, "/", headers=[(name, value)])
        await pool.close()  # any connection opened meanwhile ends, so the server sees EOF
        await server.settle()
        assert bytes(received) == b""


async def test_header_with_line_break_leaves_no_connection_open(pool: WirePool) -> None:
    async with raw_server(keepalive_ok) as server:
        with pytest.raises(ValueError):
            await pool.request("GET", "127.0.0.1", server.port, "/", headers=[("X", "a\r\nb")])
        await asyncio.sleep(0.05)
        assert pool.connections == 0


async def test_interim_1xx_answer_is_skipped(pool: WirePool) -> None:
    async def early_hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n")
        writer.write(OK_KEEPALIVE)
        await writer.drain()
        await reader.read()

    async with raw_server(early_hints) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=1.0)
        assert response.status == 200
        assert await response.read() == b"ok"


# -- streaming both ways ----------------------------------------------------------------


async def test_close_before_end_aborts_and_server_notices(pool: WirePool) -> None:
    gone = asyncio.Event()

    async def ticker(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        await out.prepare(request)
        try:
            for i in range(200):
                await out.write(b"tick %d\n" % i)
                await asyncio.sleep(0.05)
        except (ConnectionError, asyncio.CancelledError):
            gone.set()
            raise
        return out

    app = web.Application()
    app.router.add_get("/ticks", ticker)
    async with web_server(app) as port:
        response = await pool.request("GET", "127.0.0.1", port, "/ticks", read_timeout=2.0)
        async with contextlib.aclosing(response.iter_chunks()) as chunks:
            first = await anext(chunks)
        assert first.startswith(b"tick 0")
        started = time.monotonic()
        async with response:
            pass
        await asyncio.wait_for(gone.wait(), 1.0)
        assert time.monotonic() - started < 1.0
        assert pool.connections == 0
        with pytest.raises(Disconnected):
            await response.read()


async def test_large_answer_to_slow_consumer_arrives_intact(pool: WirePool) -> None:
    payload = os.urandom(4 * 1024 * 1024)

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        await reader.read()

    async with raw_server(flood) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/")
        await asyncio.sleep(0.2)  # the whole answer could arrive meanwhile, but must not
        digest = hashlib.sha256()
        sizes: list[int] = []
        async for chunk in response.iter_chunks():
            sizes.append(len(chunk))
            digest.update(chunk)
            await asyncio.sleep(0.005)
        assert digest.digest() == hashlib.sha256(payload).digest()
        # Reading paused at the high-water mark: what had piled up is far below 4 MiB.
        assert sizes[0] < 1024 * 1024
        assert response.at_eof()


async def test_read_whole_answer_above_high_water(pool: WirePool) -> None:
    payload = os.urandom(1024 * 1024)  # the proxy's _SMALL_BODY: it read()s answers this big

    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        await reader.read()

    async with raw_server(send) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/")
        assert await asyncio.wait_for(response.read(), 1.0) == payload


async def test_paused_reading_is_not_a_read_timeout(pool: WirePool) -> None:
    payload = os.urandom(1024 * 1024)

    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        await reader.read()

    async with raw_server(send) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=0.3)
        await asyncio.sleep(0.6)
        received = bytearray()
        async for chunk in response.iter_chunks():
            received += chunk
        assert bytes(received) == payload


async def test_streamed_request_body_is_sent_chunked(pool: WirePool) -> None:
    pieces = [b"a" * 10, os.urandom(100_000), b"", os.urandom(200_000), b"z"]

    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece
            await asyncio.sleep(0)

    async with web_server(echo_app()) as port:
        response = await pool.request("POST", "127.0.0.1", port, "/upload", body=body())
        seen = json.loads(await response.read())
        whole = b"".join(pieces)
        assert seen["sha256"] == hashlib.sha256(whole).hexdigest()
        assert seen["length"] == len(whole)
        assert header_values(seen, "Transfer-Encoding") == ["chunked"]
        assert header_values(seen, "Content-Length") == []


# -- TLS and pool lifetime --------------------------------------------------------------


@dataclass
class Tls:
    server: ssl.SSLContext
    client: ssl.SSLContext
    untrusting: ssl.SSLContext


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    ca = make_ca("Wire Test CA")
    cert_path, key_path = issue(
        ca, cn="127.0.0.1", uris=[], eku=[ExtendedKeyUsageOID.SERVER_AUTH], dns=["localhost"]
    ).write(tmp_path, "server")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(cert_path), str(key_path))

    def client_trusting(pem: bytes) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.load_verify_locations(cadata=pem.decode())
        return context

    return Tls(
        server=server,
        client=client_trusting(ca.cert_pem),
        untrusting=client_trusting(make_ca("Other CA").cert_pem),
    )


async def test_tls_request_works_and_untrusted_ca_is_connect_failed(
    pool: WirePool, tls: Tls
) -> None:
    async with web_server(echo_app(), ssl_context=tls.server) as port:
        for path in ("/1", "/2"):
            response = await pool.request("GET", "127.0.0.1", port, path, ssl_context=tls.client)
            assert response.status == 200
            assert json.loads(await response.read())["rawPath"] == path
        assert pool.connections == 1
        with pytest.raises(ConnectFailed):
            await pool.request("GET", "127.0.0.1", port, "/", ssl_context=tls.untrusting)
        assert pool.connections == 1


async def test_pool_close_closes_idle_connections_and_refuses_requests(pool: WirePool) -> None:
    async with raw_server(keepalive_ok) as server:
        assert await (await pool.request("GET", "127.0.0.1", server.port, "/")).read() == b"ok"
        assert pool.connections == 1
        await pool.close()
        assert pool.connections == 0
        await eventually(lambda: server.finished == 1)  # the server saw the socket close
        with pytest.raises(WireError):
            await pool.request("GET", "127.0.0.1", server.port, "/")
        assert server.accepted == 1


# -- caps on what a server can make us hold ------------------------------------------


async def _answer_with(head: bytes, then: bytes = b"") -> Handler:
    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(head + then)
        await writer.drain()
        await reader.read()

    return send


async def test_an_answer_with_too_many_headers_is_bad_response(pool: WirePool) -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_RESPONSE_HEADERS + 1))
    handler = await _answer_with(b"HTTP/1.1 200 OK\r\n" + many + b"Content-Length: 2\r\n\r\nok")
    async with raw_server(handler) as server:
        with pytest.raises(BadResponse, match="headers"):
            await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        await eventually(lambda: pool.connections == 0)


async def test_headers_up_to_the_cap_are_taken(pool: WirePool) -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_RESPONSE_HEADERS - 1))
    handler = await _answer_with(b"HTTP/1.1 200 OK\r\n" + many + b"Content-Length: 2\r\n\r\nok")
    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert len(response.raw_headers) == MAX_RESPONSE_HEADERS
        assert await response.read() == b"ok"


async def test_an_answer_head_that_never_ends_is_cut_off(pool: WirePool) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        for _ in range(64):  # 4 MiB of one header value, never terminated
            writer.write(b"a" * 65536)
            await writer.drain()
        await reader.read()

    async with raw_server(endless) as server:
        with pytest.raises(BadResponse, match="head is over"):
            await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=5.0)
        await eventually(lambda: pool.connections == 0)


async def test_a_big_head_with_its_body_in_one_read_is_not_refused(pool: WirePool) -> None:
    # 60 KiB of headers and a 200 KiB body, written at once: only head bytes count.
    head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"h" * 60_000 + b"\r\nContent-Length: 204800\r\n\r\n"
    handler = await _answer_with(head, b"b" * 204_800)
    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        assert len(await response.read()) == 204_800


async def test_read_whole_refuses_an_announced_length_over_its_limit(pool: WirePool) -> None:
    handler = await _answer_with(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n", b"x" * 10)
    async with raw_server(handler) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=2.0)
        with pytest.raises(BadResponse, match="too big to read whole"):
            await response.read(limit=65536)
        await eventually(lambda: pool.connections == 0)


async def test_read_whole_cuts_a_chunked_answer_past_its_limit(pool: WirePool) -> None:
    async def chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(64):  # 4 MiB in 64 KiB chunks, no end
            writer.write(b"10000\r\n" + b"c" * 65536 + b"\r\n")
            await writer.drain()
        await reader.read()

    async with raw_server(chunks) as server:
        response = await pool.request("GET", "127.0.0.1", server.port, "/", read_timeout=5.0)
        with pytest.raises(BadResponse, match="too big to read whole"):
            await response.read(limit=1024 * 1024)
        await eventually(lambda: pool.connections == 0)
