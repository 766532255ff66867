"""A /v1 request in flight across a partition ends within MIRBAD_UPSTREAM_READ_TIMEOUT.

The agent here is a real TLS peer holding an enrolled node's identity (so the router's
pinned mutual-TLS handshake succeeds), which takes the request and then sends nothing
more: from the router's side that is a partition or a stopped agent, since the TCP
connection stays up and no byte comes back. Without the router's read timeout these
requests wait until the client gives up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.conf import settings

from agent.identity._tls import load_identity, server_ssl_context
from core.config import load_master_config
from core.envconf import SettingError
from router import metrics
from router.app import RouterApp
from tests.factories import make_model, set_status
from tests.nodes.conftest import _enroll

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis"),
    pytest.mark.timeout(60),
]

TIMEOUT = 0.5
SLACK = 2.0  # scheduling on a loaded 2-core machine; the timeout itself is 0.5 s
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
FIRST_EVENT = b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'


@dataclasses.dataclass
class SilentAgent:
    """The peer: ``stream`` makes it send a head and one event before going silent."""

    port: int = 0
    stream: bool = False
    requests: int = 0


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[SilentAgent]:
    state = tmp_path / "state"
    node = await sync_to_async(_enroll)(state)
    context = server_ssl_context(load_identity(state, node_id=node.node_id))
    peer = SilentAgent()
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await _read_request(reader)
        peer.requests += 1
        if peer.stream:
            writer.write(SSE_HEAD + b"%x\r\n%b\r\n" % (len(FIRST_EVENT), FIRST_EVENT))
            await writer.drain()
        await asyncio.sleep(3600)  # the partition: the connection stays, nothing comes

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    peer.port = server.sockets[0].getsockname()[1]
    node.address = f"https://127.0.0.1:{peer.port}"
    await sync_to_async(node.save)()
    model = await sync_to_async(make_model)("m", node)
    placement = await sync_to_async(lambda: model.placements.get())()
    await sync_to_async(set_status)(node, "Online", {placement.instance_id: {"state": "Ready"}})
    previous = settings.MIRBAD
    settings.MIRBAD = dataclasses.replace(previous, upstream_read_timeout=TIMEOUT)
    try:
        yield peer
    finally:
        settings.MIRBAD = previous
        for writer in held:
            writer.transport.abort()
        server.close()


def _chat(stream: bool) -> dict[str, Any]:
    return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_silent_agent_before_the_answer_is_a_504_within_the_timeout(
    agent: SilentAgent, chat_key: str
) -> None:
    app = RouterApp()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    try:
        started = time.monotonic()
        response = await client.post(
            "/v1/chat/completions",
            json=_chat(stream=False),
            headers={"Authorization": f"Bearer {chat_key}"},
        )
        took = time.monotonic() - started
    finally:
        await client.aclose()
        await app.limiter().stop()
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout"
    assert "'n1'" in error["message"] and "0.5 s" in error["message"]
    assert TIMEOUT * 0.9 <= took < TIMEOUT + SLACK, f"took {took:.2f} s"
    assert agent.requests == 1, "the request reached the agent once (it is not retried)"


async def test_a_stream_whose_agent_goes_silent_is_cut_within_the_timeout(
    agent: SilentAgent, chat_key: str
) -> None:
    """After the head went out the status cannot change: the stream is ended without its
    last chunk (the ASGI server then aborts the connection), never left open."""
    agent.stream = True
    app = RouterApp()
    body = json.dumps(_chat(stream=True)).encode()
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected and waits
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "query_string": b"",
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"authorization", f"Bearer {chat_key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    errors_before = _upstream_timeouts()
    started = time.monotonic()
    try:
        await asyncio.wait_for(app(scope, receive, send), TIMEOUT + SLACK)
    finally:
        await app.limiter().stop()
    took = time.monotonic() - started
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m for m in sent[1:] if m["type"] == "http.response.body"]
    assert b"Hel" in b"".join(m.get("body", b"") for m in bodies)
    assert all(m.get("more_body") for m in bodies), "the cut stream was ended as complete"
    assert TIMEOUT * 0.9 <= took < TIMEOUT + SLACK, f"took {took:.2f} s"
    assert _upstream_timeouts() == errors_before + 1


def _upstream_timeouts() -> float:
    """mirbad_v1_errors_total for code upstream_timeout, summed over models and keys."""
    total = 0.0
    for family in metrics.METRICS.registry.collect():
        if family.name != "mirbad_v1_errors":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("code") == "upstream_timeout":
                total += sample.value
    return total


def test_the_setting_is_parsed_and_a_bad_value_names_the_variable() -> None:
    assert load_master_config({}).upstream_read_timeout == 1260.0
    parsed = load_master_config({"MIRBAD_UPSTREAM_READ_TIMEOUT": "90"})
    assert parsed.upstream_read_timeout == 90.0
    for bad in ("soon", "0", "-1", "nan"):
        with pytest.raises(SettingError, match="MIRBAD_UPSTREAM_READ_TIMEOUT"):
            load_master_config({"MIRBAD_UPSTREAM_READ_TIMEOUT": bad})
