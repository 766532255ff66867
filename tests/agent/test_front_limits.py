"""The agent listener's limits before authentication (issue 11): on the lean front's
proxy path, on connections handed to aiohttp, and on the TLS listener itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from agent_support import RunningAgent, client_context
from aiohttp import web

from agent import ConfigError, load_config
from agent.http._front import FrontListener
from agent.http._proxy import Proxy, Upstream
from protocol.http_limits import HttpLimits, aiohttp_handler_limits
from tests.http_attacks import (
    BIG_HEADER,
    COUNTED_HEADERS,
    MANY_HEADERS,
    closed_within,
    exchange,
    limits_server,
    rss_growth_under_unterminated_headers,
    status_of,
)

pytestmark = pytest.mark.timeout(60)

LIMITS = HttpLimits(head_timeout_seconds=1.0, body_idle_timeout_seconds=1.0, max_connections=20)
PROXY = b"/agent/v1/proxy/m-1/echo"
CONTROL = b"/agent/v1/control"


async def control(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"served": "aiohttp", "body": len(body)})


@contextlib.asynccontextmanager
async def front(limits: HttpLimits) -> AsyncIterator[FrontListener]:
    """The front over a proxy whose engine is never reached (no test completes a body)."""
    proxy = Proxy(
        resolve=lambda _: Upstream(port=9, key="k", served_name="demo"),
        max_in_flight=8,
        idle_timeout_seconds=5,
    )
    await proxy.start()
    app = web.Application()
    app.router.add_route("*", CONTROL.decode(), control)
    runner = web.AppRunner(app, handler_cancellation=True, **aiohttp_handler_limits(limits))
    await runner.setup()
    listener = FrontListener(
        proxy=proxy, fallback=runner.server, verdict=lambda _: None, limits=limits
    )
    listener.port = await listener.start("127.0.0.1", 0)  # type: ignore[attr-defined]  # the test keeps it there
    try:
        yield listener
    finally:
        await listener.close(1.0)
        await runner.cleanup()
        await proxy.close()


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async with front(LIMITS) as listener:
        yield listener.port  # type: ignore[attr-defined]  # set by front() above


def head(path: bytes, *lines: bytes, method: bytes = b"GET") -> bytes:
    return b"%b %b HTTP/1.1\r\nHost: x\r\n%b\r\n" % (
        method,
        path,
        b"".join(line + b"\r\n" for line in lines),
    )


@pytest.mark.parametrize("path", [PROXY, CONTROL])
async def test_oversized_heads_are_431(port: int, path: bytes) -> None:
    for attack in (BIG_HEADER, MANY_HEADERS, COUNTED_HEADERS):
        answer = await exchange(port, attack.replace(b"GET / ", b"GET %b " % path, 1))
        assert status_of(answer) == 431, answer[:200]


async def test_slowloris_is_closed_by_the_head_deadline(port: int) -> None:
    took, answer = await closed_within(port, b"GET /agent/v1/proxy/m-1/x HTTP/1.1\r\nHost", 4)
    assert status_of(answer) == 408 and 0.9 < took < 2.5, (took, answer)


async def test_a_silent_connection_is_closed_by_the_head_deadline(port: int) -> None:
    took, answer = await closed_within(port, b"", 4)
    assert answer == b"" and 0.9 < took < 2.5, (took, answer)


@pytest.mark.parametrize("path", [PROXY, CONTROL])
async def test_an_overstated_content_length_is_closed_by_the_body_deadline(
    port: int, path: bytes
) -> None:
    data = head(path, b"Content-Length: 1000", method=b"POST") + b"only ten b"
    took, answer = await closed_within(port, data, 4)
    assert b"HTTP/1.1 2" not in answer and 0.9 < took < 2.5, (took, answer)


async def test_limits_go_on_after_the_hand_off_to_aiohttp(port: int) -> None:
    """A control request hands the connection to aiohttp; the next head is still bounded."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head(CONTROL, b"Content-Length: 2", method=b"POST") + b"hi")
        status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert status.startswith(b"HTTP/1.1 200")
        length = int(status.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(length)) == {"served": "aiohttp", "body": 2}
        writer.write(b"GET /agent/v1/control HTTP/1.1\r\nHo")  # and nothing more
        answer = await asyncio.wait_for(reader.read(), 4)
    finally:
        writer.close()
    assert status_of(answer) == 408, answer


async def test_connections_over_the_cap_get_503_handed_off_ones_included() -> None:
    async with front(replace(LIMITS, head_timeout_seconds=30.0, max_connections=3)) as listener:
        port = listener.port  # type: ignore[attr-defined]  # set by front() above
        handed = await asyncio.open_connection("127.0.0.1", port)
        handed[1].write(head(CONTROL))
        assert (await asyncio.wait_for(handed[0].readuntil(b"\r\n\r\n"), 5)).startswith(
            b"HTTP/1.1 200"
        )
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        took, answer = await closed_within(port, head(CONTROL), 3)
        assert status_of(answer) == 503 and b"server_busy" in answer, answer
        assert took < 1.5
        handed[1].close()  # the handed-off connection gives its slot back
        await asyncio.sleep(0.2)
        answer = await exchange(port, head(CONTROL, b"Connection: close"))
        assert status_of(answer) == 200, answer
        for _, writer in idle:
            writer.close()


async def test_the_unterminated_headers_attack_stays_under_16_mib() -> None:
    with limits_server("agent") as (pid, port):
        growth = await rss_growth_under_unterminated_headers(pid, port)
    print(f"agent: RSS growth {growth / 2**20:.1f} MiB under 16 x 16 MiB unterminated headers")
    assert growth < 16 * 2**20


# -- the real agent listener (mTLS) ------------------------------------------------------


@pytest.mark.parametrize("running_agent", [{"http_head_timeout_seconds": 1.0}], indirect=True)
async def test_a_stalled_tls_handshake_is_closed_by_the_head_deadline(
    running_agent: RunningAgent,
) -> None:
    took, answer = await closed_within(running_agent.server.port, b"", 4)  # no ClientHello
    assert answer == b"" and took < 2.5, took


async def test_aiohttp_takes_the_heads_the_front_allows(running_agent: RunningAgent) -> None:
    """aiohttp's own 8190-byte line limit would answer a 20 KB header 400 itself."""
    ctx: ssl.SSLContext = client_context(
        running_agent.pki, running_agent.pki.master, running_agent.tmp / "c"
    )
    data = head(b"/agent/v1/info", b"X-Pad: " + b"p" * 20_000, b"Connection: close")
    answer = await exchange(running_agent.server.port, data, context=ctx)
    assert status_of(answer) == 200 and b'"nodeId"' in answer, answer[:300]


def test_the_limits_are_config_keys_with_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "agent.json"
    path.write_text(
        json.dumps({"NodeId": "n1", "StateDirectory": str(tmp_path), "HttpMaxHeaders": 50})
    )
    env = {
        "MIRBAD_AGENT_HTTP_MAX_HEAD_BYTES": "32768",
        "MIRBAD_AGENT_HTTP_HEAD_TIMEOUT_SECONDS": "2.5",
        "MIRBAD_AGENT_HTTP_BODY_IDLE_TIMEOUT_SECONDS": "7",
        "MIRBAD_AGENT_HTTP_MAX_CONNECTIONS": "300",
    }
    assert load_config(path, environ=env).http_limits == HttpLimits(
        max_head_bytes=32768,
        max_headers=50,
        head_timeout_seconds=2.5,
        body_idle_timeout_seconds=7.0,
        max_connections=300,
    )
    assert load_config(path, environ={}).http_limits == replace(HttpLimits(), max_headers=50)
    with pytest.raises(ConfigError, match="MIRBAD_AGENT_HTTP_MAX_CONNECTIONS"):
        load_config(path, environ={"MIRBAD_AGENT_HTTP_MAX_CONNECTIONS": "0"})
