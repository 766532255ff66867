"""The mTLS listener: only the master's client certificate gets an answer."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl

import aiohttp
import pytest
from agent_support import Pki, RunningAgent, client_context

pytestmark = pytest.mark.timeout(30)


async def raw_exchange(
    agent: RunningAgent, ctx: ssl.SSLContext, path: bytes = b"/agent/v1/info"
) -> bytes:
    """Send one keep-alive request and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.server.port, ssl=ctx)
    try:
        writer.write(b"GET %b HTTP/1.1\r\nHost: agent\r\nConnection: keep-alive\r\n\r\n" % path)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=5)
    finally:
        writer.close()


async def test_master_certificate_accepted(running_agent: RunningAgent) -> None:
    async with running_agent.session.get(running_agent.url("/agent/v1/info")) as resp:
        assert resp.status == 200
        assert (await resp.json())["nodeId"] == "n1"


async def test_node_certificate_from_same_ca_refused_and_closed(
    running_agent: RunningAgent, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    node = pki.node("n2")
    ctx = client_context(pki, node, running_agent.tmp / "n2")
    with caplog.at_level(logging.WARNING, logger="mirbad.agent.server"):
        # reader.read() returning at all (rather than timing out) proves the close.
        data = await raw_exchange(running_agent, ctx)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403")
    assert b"Connection: close" in head
    assert b'"client_not_master"' in body
    assert "Refused a master client certificate" in caplog.text


async def test_node_certificate_refused_on_the_proxy_path_too(
    running_agent: RunningAgent, pki: Pki
) -> None:
    # Proxy requests are served by the lean front (D32), not behind the middleware.
    ctx = client_context(pki, pki.node("n4"), running_agent.tmp / "n4")
    data = await raw_exchange(running_agent, ctx, b"/agent/v1/proxy/some-instance/v1/models")
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403")
    assert b"Connection: close" in head and b"x-mirbad-agent-error: client_not_master" in head
    assert json.loads(body)["error"]["code"] == "client_not_master"


async def test_node_certificate_refused_via_http_client(
    running_agent: RunningAgent, pki: Pki
) -> None:
    ctx = client_context(pki, pki.node("n3"), running_agent.tmp / "n3")
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session,
        session.get(running_agent.url("/agent/v1/status")) as resp,
    ):
        assert resp.status == 403
        body = await resp.json()
        assert body["error"]["code"] == "client_not_master"


async def test_certificate_from_another_ca_fails_handshake(
    running_agent: RunningAgent, pki: Pki
) -> None:
    ctx = client_context(pki, pki.other_master, running_agent.tmp / "other")
    try:
        data = await raw_exchange(running_agent, ctx)
    except (ssl.SSLError, ConnectionError):
        return
    assert b"HTTP/1.1" not in data, "a certificate from another CA got an HTTP answer"


async def test_no_client_certificate_fails_handshake(running_agent: RunningAgent, pki: Pki) -> None:
    ctx = client_context(pki, None, running_agent.tmp / "none")
    try:
        data = await raw_exchange(running_agent, ctx)
    except (ssl.SSLError, ConnectionError):
        return
    assert b"HTTP/1.1" not in data


async def test_plain_http_gets_nothing(running_agent: RunningAgent) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", running_agent.server.port)
    writer.write(b"GET /agent/v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    try:
        data = await asyncio.wait_for(reader.read(), timeout=5)
    except ConnectionError:
        data = b""
    writer.close()
    assert b'"nodeId"' not in data
