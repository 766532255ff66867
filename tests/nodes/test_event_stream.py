"""The monitor's reading of an agent's event stream (nodes.agent_client): events from
bytes, whatever the chunking, and a bound on an event that never ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from nodes import agent_client
from nodes.agent_client import AgentError, AsyncAgentClient, parse_event
from tests.nodes.conftest import Enrolled


def test_an_event_is_its_type_and_its_object() -> None:
    assert parse_event(b'id: 7\nevent: heartbeat\ndata: {"time": "x", "n": [1, 2]}') == (
        "heartbeat",
        {"time": "x", "n": [1, 2]},
    )
    assert parse_event(b'data: {"a":\ndata: 1}') == ("message", {"a": 1})  # two data lines
    assert parse_event(b": a comment\nid: 3") is None  # no data: no event
    assert parse_event(b"event: instance\ndata: [1, 2]") == ("instance", {})  # not an object
    assert parse_event(b"event: instance\ndata: {broken") == ("instance", {})


@pytest.mark.django_db(transaction=True)
async def test_the_stream_yields_each_event_once_in_order(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real agent's stream: hello, then heartbeats carrying the telemetry sample."""
    client = AsyncAgentClient(node=enrolled.node)
    seen: list[tuple[str, dict[str, Any]]] = []
    try:
        async for name, data in client.events(read_timeout=5, telemetry=True):
            seen.append((name, data))
            if len(seen) == 3:
                break
    finally:
        await client.aclose()
    assert [name for name, _ in seen] == ["hello", "heartbeat", "heartbeat"]
    assert seen[0][1]["nodeId"] == "n1"
    assert seen[1][1]["telemetry"]["memory"]["totalBytes"] > 0


@pytest.mark.django_db(transaction=True)  # the client reads the master's CA
async def test_events_split_anywhere_and_an_event_that_never_ends_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks cut across lines and events (TLS records do); a peer that sends data
    without the blank line that ends an event is refused past EVENT_MAX_BYTES."""
    from nodes.models import Node

    def streaming(chunks: list[bytes]) -> httpx.AsyncClient:
        async def body() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        def answer(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=body())

        return httpx.AsyncClient(base_url="https://agent", transport=httpx.MockTransport(answer))

    node = Node(node_id="n1", address="https://127.0.0.1:1")  # never saved: no agent dialled
    client = AsyncAgentClient(node=node)
    wire = b'event: hello\ndata: {"a": 1}\n\nevent: heartbeat\r\ndata: {"b": 2}\r\n\r\n'
    chunks = [wire[i : i + 5] for i in range(0, len(wire), 5)]
    monkeypatch.setattr(client, "_current", lambda: streaming(chunks))
    got = [e async for e in client.events(read_timeout=5)]
    assert got == [("hello", {"a": 1}), ("heartbeat", {"b": 2})]

    monkeypatch.setattr(agent_client, "EVENT_MAX_BYTES", 1000)
    endless = [b"data: " + b"x" * 300] * 10  # 3 KB and no end
    monkeypatch.setattr(client, "_current", lambda: streaming(endless))
    with pytest.raises(AgentError, match="an event over"):
        async for _ in client.events(read_timeout=5):
            pass
