"""The streaming proxy against an in-process upstream (no TLS, no processes), behind
the agent's lean front and behind aiohttp's route."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent import ModelNotRunning
from agent.http._front import FrontListener
from agent.http._proxy import LLAMA_AUTO_SLOTS, Proxy, Upstream, engine_slots
from agent.http._server import error_middleware

pytestmark = pytest.mark.timeout(30)

FLOOD = 64 * 65536 * 16  # 64 MiB: far more than the socket buffers on the way hold


class _HeadersWithFirstWrite(web.StreamResponse):
    _send_headers_immediately = False


@dataclass
class Env:
    base: str
    proxy: Proxy
    release: asyncio.Event = field(default_factory=asyncio.Event)
    release_last: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    ready: bool = True
    flood_sent: int = 0
    front: FrontListener | None = None
    slots: int | None = None

    def url(self, path: str) -> str:
        return f"{self.base}/agent/v1/proxy/m-1{path}"


def upstream_app(env_holder: dict[str, Env]) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "method": request.method,
                "rawPath": request.raw_path,
                "headers": {k: v for k, v in request.headers.items()},
                "body": body.decode(),
            }
        )

    async def sse(request: web.Request) -> web.StreamResponse:
        env = env_holder["env"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        try:
            await asyncio.wait_for(env.release.wait(), 10)
        except asyncio.CancelledError:
            env.cancelled.set()
            raise
        await resp.write(b"data: second\n\n")
        await resp.write_eof()
        return resp

    async def sse_at_once(request: web.Request) -> web.StreamResponse:
        # Headers and the first event in one write, as llama-server sends them.
        resp = _HeadersWithFirstWrite(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await asyncio.wait_for(env_holder["env"].release.wait(), 10)
        await resp.write(b"data: second\n\n")
        await resp.write_eof()
        return resp

    async def sse_burst(request: web.Request) -> web.StreamResponse:
        # One event alone, then three written back to back (they reach the proxy in one
        # read, as an engine's chunks do when the proxy lags), then one alone again.
        env = env_holder["env"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: e1\n\n")
        await asyncio.wait_for(env.release.wait(), 10)
        for event in (b"data: e2\n\n", b"data: e3\n\n", b"data: e4\n\n"):
            await resp.write(event)
        await asyncio.wait_for(env.release_last.wait(), 10)
        await resp.write(b"data: e5\n\n")
        await resp.write_eof()
        return resp

    async def flood(request: web.Request) -> web.StreamResponse:
        # FLOOD bytes as an event stream, as fast as the proxy takes them.
        env = env_holder["env"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        piece = b"data: " + b"x" * 65528 + b"\n\n"
        while env.flood_sent < FLOOD:
            await resp.write(piece)
            env.flood_sent += len(piece)
        await resp.write_eof()
        return resp

    async def stall(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            env_holder["env"].cancelled.set()
            raise
        return web.Response(text="late")

    async def stall_mid(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"partial")
        await asyncio.sleep(30)
        return resp

    app = web.Application()
    app.router.add_route("*", "/echo{tail:.*}", echo)
    app.router.add_get("/sse", sse)
    app.router.add_get("/sse-at-once", sse_at_once)
    app.router.add_get("/sse-burst", sse_burst)
    app.router.add_get("/flood", flood)
    app.router.add_get("/stall", stall)
    app.router.add_get("/stall-mid", stall_mid)
    return app


async def control(request: web.Request) -> web.Response:
    return web.json_response({"served": "aiohttp", "path": request.path})


@contextlib.asynccontextmanager
async def environment(kind: str) -> AsyncIterator[Env]:
    holder: dict[str, Env] = {}
    up_runner = web.AppRunner(upstream_app(holder), handler_cancellation=True)
    await up_runner.setup()
    up_site = web.TCPSite(up_runner, "127.0.0.1", 0)
    await up_site.start()
    up_port = up_runner.addresses[0][1]

    def resolve(instance_id: str) -> Upstream:
        if not holder["env"].ready:
            raise ModelNotRunning(f"model 'demo' (instance {instance_id}) is Starting, not Ready")
        return Upstream(
            port=up_port, key="instance-key", served_name="demo", slots=holder["env"].slots
        )

    proxy = Proxy(resolve=resolve, max_in_flight=2, idle_timeout_seconds=0.5)
    await proxy.start()
    app = web.Application(middlewares=[error_middleware])
    app.router.add_route("*", "/agent/v1/proxy/{instanceId}/{path:.*}", proxy.handle)
    app.router.add_get("/agent/v1/control", control)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    front: FrontListener | None = None
    if kind == "front":
        front = FrontListener(proxy=proxy, fallback=runner.server, verdict=lambda _: None)
        port = await front.start("127.0.0.1", 0)
    else:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
    holder["env"] = Env(base=f"http://127.0.0.1:{port}", proxy=proxy, front=front)
    try:
        yield holder["env"]
    finally:
        if holder["env"].front is not None:
            await holder["env"].front.close(1.0)
        await runner.cleanup()
        await proxy.close()
        await up_runner.cleanup()


@pytest.fixture(params=["front", "aiohttp"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    """The proxy behind the agent's lean front (D32) and behind aiohttp's route (which
    serves proxy requests on connections that began with a control request)."""
    async with environment(request.param) as env:
        yield env


@pytest.fixture
async def front_env() -> AsyncIterator[Env]:
    async with environment("front") as env:
        yield env


async def test_headers_path_query_and_authorization(env: Env) -> None:
    headers = {
        "Authorization": "Bearer client-key",
        "X-Custom": "yes",
        "Connection": "keep-alive, X-Drop-Me",
        "X-Drop-Me": "1",
        "Proxy-Authorization": "Basic x",
        "TE": "trailers",
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(env.url("/echo/a%2Fb?x=1&y=%20z"), data=b"hello", headers=headers) as resp,
    ):
        assert resp.status == 200
        seen = await resp.json()
    assert seen["method"] == "POST"
    assert seen["rawPath"] == "/echo/a%2Fb?x=1&y=%20z"
    assert seen["body"] == "hello"
    up = {k.lower(): v for k, v in seen["headers"].items()}
    assert up["authorization"] == "Bearer instance-key"
    assert up["x-custom"] == "yes"
    for dropped in ("x-drop-me", "proxy-authorization", "te"):
        assert dropped not in up
    assert up["host"].startswith("127.0.0.1:")


async def test_engine_errors_pass_through_unmarked(env: Env) -> None:
    async with aiohttp.ClientSession() as session, session.get(env.url("/missing")) as resp:
        assert resp.status == 404
        assert "x-mirbad-agent-error" not in resp.headers
    env.ready = False
    async with aiohttp.ClientSession() as session, session.get(env.url("/echo")) as resp:
        assert resp.headers["x-mirbad-agent-error"] == "model_not_running"


async def test_request_body_streams_chunked(env: Env) -> None:
    async def body() -> AsyncIterator[bytes]:
        for i in range(50):
            yield f"{i:04d}".encode() * 1000

    async with (
        aiohttp.ClientSession() as session,
        session.post(env.url("/echo"), data=body()) as resp,
    ):
        seen = await resp.json()
    assert len(seen["body"]) == 50 * 4000
    assert seen["body"].startswith("0000") and seen["body"].endswith("0049")


async def test_sse_chunk_arrives_before_upstream_finishes(env: Env) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(env.url("/sse")) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first == b"data: first\n\n"
        assert not env.release.is_set(), "upstream must still be waiting"
        env.release.set()
        rest = await asyncio.wait_for(resp.content.read(), 5)
    assert rest == b"data: second\n\n"


async def test_idle_timeout_before_headers_is_502(env: Env) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(env.url("/stall")) as resp,
    ):
        assert resp.status == 502
        body = await resp.json()
    assert body["error"] == {
        "code": "upstream_unavailable",
        "message": "Model 'demo' sent no response for 0.5 s; it may be stalled or overloaded.",
    }


async def test_idle_timeout_mid_stream_aborts(env: Env) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(env.url("/stall-mid")) as resp:
            assert resp.status == 200
            assert await resp.content.readexactly(7) == b"partial"
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(resp.content.read(), 5)


async def test_in_flight_limit(env: Env) -> None:
    async with aiohttp.ClientSession() as session:
        held = [await session.get(env.url("/sse")) for _ in range(2)]
        assert env.proxy.in_flight == 2
        async with session.get(env.url("/echo")) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "server_busy"
        env.release.set()
        for resp in held:
            await resp.read()
            resp.release()
    assert env.proxy.in_flight == 0


async def test_not_ready_is_503(env: Env) -> None:
    env.ready = False
    async with aiohttp.ClientSession() as session, session.get(env.url("/echo")) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "model_not_running"


async def test_client_disconnect_cancels_upstream(env: Env) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.get(env.url("/sse"))
        await resp.content.readuntil(b"\n\n")
        resp.close()  # drop the connection mid-stream
    await asyncio.wait_for(env.cancelled.wait(), 5)
    await asyncio.sleep(0.1)
    assert env.proxy.in_flight == 0


async def test_upstream_down_is_502() -> None:
    def resolve(instance_id: str) -> Upstream:
        return Upstream(port=1, key="k", served_name="demo")

    proxy = Proxy(resolve=resolve, max_in_flight=4, idle_timeout_seconds=0)
    await proxy.start()
    app = web.Application(middlewares=[error_middleware])
    app.router.add_route("*", "/agent/v1/proxy/{instanceId}/{path:.*}", proxy.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/agent/v1/proxy/m-1/v1/models"
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert resp.status == 502
            body: dict[str, Any] = json.loads(await resp.text())
        assert body["error"]["code"] == "upstream_unavailable"
        assert "could not be reached" in body["error"]["message"]
    finally:
        await runner.cleanup()
        await proxy.close()


async def test_headers_and_first_chunk_leave_in_one_write(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine sent at once, the proxy writes at once (the router wakes once)."""
    import asyncio.selector_events as selector_events

    writes: list[bytes] = []
    original = selector_events._SelectorSocketTransport.write

    def spy(self: Any, data: Any) -> None:
        writes.append(bytes(data))
        original(self, data)

    monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", spy)
    port = int(env.base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /agent/v1/proxy/m-1/sse-at-once HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.readuntil(b"data: first\n\n"), 5)
        assert first.startswith(b"HTTP/1.1 200")
        to_client = [w for w in writes if b"HTTP/1.1 200" in w or b"data: first" in w]
        # One from the upstream to the proxy, one from the proxy to us: each holds both.
        assert len(to_client) == 2, to_client
        assert all(b"HTTP/1.1 200" in w and b"data: first" in w for w in to_client)
        env.release.set()
        rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        assert b"data: second" in rest
    finally:
        writer.close()


async def test_waiting_chunks_leave_in_one_write_and_a_lone_one_at_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks already buffered when the relay wakes go on in one write; a chunk that is
    alone goes on at once, while the engine has sent nothing more (no timer, no wait)."""
    import asyncio.selector_events as selector_events

    writes: list[bytes] = []
    original = selector_events._SelectorSocketTransport.write

    def spy(self: Any, data: Any) -> None:
        writes.append(bytes(data))
        original(self, data)

    monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", spy)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(env))
    try:
        writer.write(b"GET /agent/v1/proxy/m-1/sse-burst HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.readuntil(b"data: e1\n\n"), 5)
        assert first.startswith(b"HTTP/1.1 200")
        assert not env.release.is_set()  # the engine holds e2: e1 did not wait for it
        env.release.set()
        await asyncio.wait_for(reader.readuntil(b"data: e4\n\n"), 5)
        burst = [w for w in writes if b"data: e2" in w or b"data: e3" in w or b"data: e4" in w]
        # The engine wrote each one on its own; the proxy wrote them together, once.
        together = [w for w in burst if b"data: e2" in w and b"data: e4" in w]
        assert len(together) == 1, burst
        assert together[0].count(b"data: e3") == 1
        assert len(burst) == 4, burst
        assert not env.release_last.is_set()
        env.release_last.set()
        rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        assert b"data: e5\n\n" in rest
    finally:
        writer.close()


async def test_a_client_that_does_not_read_holds_the_engine_back(env: Env) -> None:
    """Back-pressure end to end: while the client reads nothing the engine's writes
    stall (the proxy stops reading it, it does not buffer the stream), and when the
    client reads again every byte arrives."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(env))
    try:
        writer.write(b"GET /agent/v1/proxy/m-1/flood HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        await asyncio.sleep(1.0)  # twice the idle timeout: a held stream is not idle
        stalled_at = env.flood_sent
        assert stalled_at < FLOOD // 2, stalled_at
        await asyncio.sleep(0.3)
        assert env.flood_sent == stalled_at
        received = 0
        while True:
            data = await asyncio.wait_for(reader.read(1 << 20), 10)
            if not data:
                break
            received += data.count(b"x")
            if data.endswith(b"0\r\n\r\n"):
                break
        assert received == FLOOD // (65528 + 8) * 65528
        assert env.flood_sent == FLOOD
    finally:
        writer.close()


# -- the lean front's own behaviour (D32) ------------------------------------------------


async def _exchange(port: int, data: bytes, until: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(until), 5)
    finally:
        writer.close()


def _port(env: Env) -> int:
    return int(env.base.rsplit(":", 1)[1])


async def test_one_connection_carries_proxy_and_control_requests_in_any_order(
    front_env: Env,
) -> None:
    env = front_env
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for path in ("/echo/1", "/echo/2"):  # keep-alive on the lean path
            async with session.post(env.url(path), data=b"x") as resp:
                assert (await resp.json())["rawPath"] == path
        # A control request hands the connection to aiohttp, with the bytes read so far.
        async with session.get(f"{env.base}/agent/v1/control") as resp:
            assert await resp.json() == {"served": "aiohttp", "path": "/agent/v1/control"}
        # On that connection aiohttp's route serves the proxy from now on.
        async with session.post(env.url("/echo/3"), data=b"y") as resp:
            assert (await resp.json())["body"] == "y"
        assert env.front is not None and not env.front.connections  # it is aiohttp's now
    assert env.proxy.in_flight == 0


async def test_a_request_split_across_reads_is_handed_off_whole(front_env: Env) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(front_env))
    try:
        for piece in (b"GET /agent/v1/con", b"trol HTTP/1.1\r\nHo", b"st: x\r\n\r\n"):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)
        answer = await asyncio.wait_for(reader.readuntil(b"}"), 5)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and b'"served": "aiohttp"' in answer


async def test_pipelined_requests_get_the_first_answer_then_a_close(front_env: Env) -> None:
    one = b"GET /agent/v1/proxy/m-1/echo/a HTTP/1.1\r\nHost: x\r\n\r\n"
    two = b"GET /agent/v1/proxy/m-1/echo/b HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(front_env))
    try:
        writer.write(one + two)
        await writer.drain()
        everything = await asyncio.wait_for(reader.read(), 5)  # returns: it was closed
    finally:
        writer.close()
    assert everything.count(b"HTTP/1.1 200") == 1 and b"/echo/a" in everything
    assert b"Connection: close" in everything


async def test_garbage_is_a_400_and_a_close(front_env: Env) -> None:
    answer = await _exchange(_port(front_env), b"NOT HTTP AT ALL\r\n\r\n", b"}")
    assert answer.startswith(b"HTTP/1.1 400") and b"invalid_request" in answer


async def test_a_huge_request_head_is_refused(front_env: Env) -> None:
    head = b"GET /agent/v1/proxy/m-1/echo HTTP/1.1\r\n" + b"X-Big: " + b"a" * 70_000
    answer = await _exchange(_port(front_env), head, b"}")
    assert answer.startswith(b"HTTP/1.1 431") and b"request head is over" in answer


async def test_closing_waits_for_answers_in_progress(front_env: Env) -> None:
    env = front_env
    assert env.front is not None
    async with aiohttp.ClientSession() as session:
        resp = await session.get(env.url("/sse"))
        assert await resp.content.readuntil(b"\n\n") == b"data: first\n\n"
        closing = asyncio.create_task(env.front.close(5.0))
        await asyncio.sleep(0.1)
        assert not closing.done(), "close() must wait for the stream in progress"
        env.release.set()
        assert await asyncio.wait_for(resp.content.read(), 5) == b"data: second\n\n"
        await asyncio.wait_for(closing, 5)
    env.front = None


@pytest.mark.parametrize("slots", [1, None])
async def test_idle_connections_kept_per_engine_are_capped_to_its_slots(
    env: Env, slots: int | None
) -> None:
    env.slots = slots
    async with aiohttp.ClientSession() as session:
        held = [await session.get(env.url("/sse")) for _ in range(2)]  # two engine requests
        env.release.set()
        for resp in held:
            assert await resp.read() == b"data: first\n\ndata: second\n\n"
            resp.release()
    pool = env.proxy._pool
    assert pool is not None
    # One slot: the engine can start one request at once, so one connection is kept.
    await asyncio.sleep(0.05)
    assert pool.connections == (1 if slots == 1 else 2)


@pytest.mark.parametrize(
    ("args", "slots"),
    [
        (("-m", "{model}", "-c", "1024", "-np", "1", "-ngl", "0"), 1),
        (("-np", "2", "--parallel", "8"), 8),  # llama-server takes the last one
        (("--parallel=3",), 3),
        (("-m", "{model}"), LLAMA_AUTO_SLOTS),  # none given: llama-server's auto
        (("-np", "-1"), LLAMA_AUTO_SLOTS),
        (("-np", "many"), LLAMA_AUTO_SLOTS),
        (("-np",), LLAMA_AUTO_SLOTS),
    ],
)
def test_engine_slots_read_from_the_argv(args: tuple[str, ...], slots: int) -> None:
    assert engine_slots(args) == slots


async def test_engine_closing_a_kept_connection_as_a_request_arrives_is_not_a_502() -> None:
    """The agent-to-engine hop of the lost-request report: the engine closes a kept
    connection just as the next request reaches it, unanswered."""
    connections = 0

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        mine = connections
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)  # the body, b"{}"
                if mine == 1 and served:
                    return  # the first connection, reused: closed unanswered
                served.append(mine)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    served: list[int] = []
    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = Upstream(port=port, key="k", served_name="demo", slots=1)
    proxy = Proxy(resolve=lambda _: upstream, max_in_flight=4, idle_timeout_seconds=2.0)
    await proxy.start()
    try:
        for _ in range(2):
            response = await proxy.open(upstream, "POST", "/v1/x", [], b"{}")
            try:
                assert response.status == 200
                assert await proxy.read_whole(response, upstream) == b"ok"
            finally:
                response.close()
        assert served == [1, 2]  # the second request was answered on a fresh connection
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
