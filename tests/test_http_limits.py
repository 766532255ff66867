"""The web port's limits before authentication (issue 11): uvicorn with
``mirbad_site.http_limits.LimitedHttpToolsProtocol``, in-process on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from core.config import MasterConfig, load_master_config
from core.envconf import SettingError
from mirbad_site.http_limits import LimitedHttpToolsProtocol
from protocol.http_limits import HttpLimits
from tests.http_attacks import (
    BIG_HEADER,
    COUNTED_HEADERS,
    MANY_HEADERS,
    closed_within,
    exchange,
    limits_server,
    request,
    rss_growth_under_unterminated_headers,
    status_of,
)
from tests.limits_server import echo_app

ROOT = Path(__file__).resolve().parent.parent
LIMITS = HttpLimits(head_timeout_seconds=1.0, body_idle_timeout_seconds=1.0, max_connections=20)


@contextlib.asynccontextmanager
async def web_server(limits: HttpLimits) -> AsyncIterator[int]:
    class Protocol(LimitedHttpToolsProtocol):
        pass

    Protocol.limits = limits
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(echo_app, http=Protocol, lifespan="off", log_level="warning")
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        yield sock.getsockname()[1]
    finally:
        await server.shutdown(sockets=[sock])
        sock.close()


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async with web_server(LIMITS) as bound:
        yield bound


async def test_normal_requests_pass_on_one_connection(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for body in (b"", b"hello"):
            head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
            writer.write(head + body)
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert answer.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(len(str(len(body)))) == str(len(body)).encode()
    finally:
        writer.close()


async def test_an_8_mb_header_is_431(port: int) -> None:
    answer = await exchange(port, BIG_HEADER)
    assert status_of(answer) == 431, answer[:200]
    assert b"request head is over 65536 bytes" in answer


async def test_200000_headers_are_431(port: int) -> None:
    answer = await exchange(port, MANY_HEADERS)
    assert status_of(answer) == 431, answer[:200]


async def test_more_than_100_small_headers_are_431(port: int) -> None:
    answer = await exchange(port, COUNTED_HEADERS)
    assert status_of(answer) == 431, answer[:200]
    assert b"more than 100 headers" in answer


async def test_heads_under_the_limit_pass_with_a_body_in_the_same_write(port: int) -> None:
    """No false 431: a 60 KiB head, and a 30 KiB head with a 200 KiB body behind it."""
    for head_pad, body_size in ((60_000, 0), (30_000, 200_000)):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = b"POST / HTTP/1.1\r\nHost: x\r\nX-Pad: %b\r\nContent-Length: %d\r\n\r\n" % (
                b"p" * head_pad,
                body_size,
            )
            writer.write(head + b"b" * body_size)
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert answer.startswith(b"HTTP/1.1 200"), answer
        finally:
            writer.close()


async def test_slowloris_is_closed_by_the_head_deadline(port: int) -> None:
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
            for i in range(40):  # a header line every 0.2 s, never the blank line
                await asyncio.sleep(0.2)
                writer.write(b"X-%d: y\r\n" % i)

    dripping = asyncio.create_task(drip())
    try:
        answer = await asyncio.wait_for(reader.read(), 4)
    finally:
        dripping.cancel()
        writer.close()
    took = time.monotonic() - started
    assert status_of(answer) == 408, answer
    assert 0.9 < took < 2.5, took


async def test_a_silent_connection_is_closed_by_the_head_deadline(port: int) -> None:
    took, answer = await closed_within(port, b"", 4)
    assert answer == b"" and 0.9 < took < 2.5, (took, answer)


async def test_an_overstated_content_length_is_closed_by_the_body_deadline(port: int) -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    took, answer = await closed_within(port, head + b"only ten b", 4)
    assert answer == b"" and 0.9 < took < 2.5, (took, answer)


async def test_a_slow_but_steady_body_is_not_cut(port: int) -> None:
    """The body deadline is an idle time, not a total: 2.4 s of body in 0.4 s steps."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\n")
        for _ in range(6):
            await asyncio.sleep(0.4)
            writer.write(b"x")
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


async def test_connections_over_the_cap_get_503_and_a_close() -> None:
    limits = replace(LIMITS, head_timeout_seconds=30.0, max_connections=5)
    async with web_server(limits) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        await asyncio.sleep(0.1)
        took, answer = await closed_within(port, request(), 3)
        assert status_of(answer) == 503 and b"too many connections" in answer, answer
        assert took < 1.5
        held.pop()[1].close()
        await asyncio.sleep(0.1)
        answer = await exchange(
            port, request().replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        )
        assert status_of(answer) == 200, answer
        for _, writer in held:
            writer.close()


async def ws_echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await echo_app(scope, receive, send)
        return
    assert scope["type"] == "websocket"
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    while (message := await receive())["type"] == "websocket.receive":
        await send({"type": "websocket.send", "text": message["text"]})


async def test_a_websocket_outlives_the_head_and_body_deadlines() -> None:
    """The console's websockets: after the upgrade the HTTP/1.1 limits stop."""
    from websockets.asyncio.client import connect

    class Protocol(LimitedHttpToolsProtocol):
        limits = LIMITS

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        ws_echo_app, http=Protocol, ws="auto", lifespan="off", log_level="warning"
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        async with connect(f"ws://127.0.0.1:{sock.getsockname()[1]}/ws") as ws:
            await asyncio.sleep(2.5)  # past both 1 s deadlines
            await ws.send("still here")
            assert await asyncio.wait_for(ws.recv(), 5) == "still here"
    finally:
        await server.shutdown(sockets=[sock])
        sock.close()


async def test_the_unterminated_headers_attack_stays_under_16_mib() -> None:
    with limits_server("web") as (pid, port):
        growth = await rss_growth_under_unterminated_headers(pid, port)
    print(f"web: RSS growth {growth / 2**20:.1f} MiB under 16 x 16 MiB unterminated headers")
    assert growth < 16 * 2**20


# -- settings and wiring ----------------------------------------------------------------


def test_settings_default_to_the_shared_limits() -> None:
    assert load_master_config(env={}).http_limits == HttpLimits()


def test_settings_parse_and_fail_naming_the_variable() -> None:
    cfg: MasterConfig = load_master_config(
        env={
            "MIRBAD_HTTP_MAX_HEAD_BYTES": "32768",
            "MIRBAD_HTTP_MAX_HEADERS": "50",
            "MIRBAD_HTTP_HEAD_TIMEOUT_SECONDS": "2.5",
            "MIRBAD_HTTP_BODY_IDLE_TIMEOUT_SECONDS": "7",
            "MIRBAD_HTTP_MAX_CONNECTIONS": "300",
        }
    )
    assert cfg.http_limits == HttpLimits(
        max_head_bytes=32768,
        max_headers=50,
        head_timeout_seconds=2.5,
        body_idle_timeout_seconds=7.0,
        max_connections=300,
    )
    for name, value in (
        ("MIRBAD_HTTP_MAX_HEAD_BYTES", "12"),
        ("MIRBAD_HTTP_MAX_HEADERS", "many"),
        ("MIRBAD_HTTP_HEAD_TIMEOUT_SECONDS", "0"),
        ("MIRBAD_HTTP_BODY_IDLE_TIMEOUT_SECONDS", "-1"),
        ("MIRBAD_HTTP_MAX_CONNECTIONS", "0"),
    ):
        with pytest.raises(SettingError, match=name):
            load_master_config(env={name: value})


@pytest.mark.parametrize("path", ["mirbad_site/launcher.py", "Dockerfile", "docker-compose.yml"])
def test_every_web_command_selects_the_limited_protocol(path: str) -> None:
    text = (ROOT / path).read_text()
    assert "mirbad_site.http_limits:LimitedHttpToolsProtocol" in text
