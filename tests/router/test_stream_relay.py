"""The router's relay of a streamed answer (router.relay.stream) over the real wire client:
what has arrived goes on in one ASGI message, a lone chunk goes on at once, and the SSE
filter sees whole events whatever the pieces."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from protocol.wire import WirePool
from router import sse
from router.relay import stream

pytestmark = pytest.mark.timeout(30)

E1 = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
E2 = b'data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":null}]}\n\n'
E3 = b'data: {"choices":[{"index":0,"delta":{"content":"c"},"finish_reason":null}]}\n\n'
E4 = b'data: {"choices":[{"index":0,"delta":{"content":"d"},"finish_reason":null}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}\n\n'
DONE = b"data: [DONE]\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@dataclass
class Engine:
    """A raw HTTP/1.1 server sending chunked SSE in steps the test releases."""

    port: int = 0
    steps: list[list[bytes]] = field(default_factory=list)
    go: list[asyncio.Event] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)  # the body: {}
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for step, go in zip(self.steps, self.go, strict=True):
            await go.wait()
            for piece in step:
                writer.write(_chunk(piece))  # each piece its own write, back to back
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    eng = Engine()
    server = await asyncio.start_server(eng.handle, "127.0.0.1", 0)
    eng.port = server.sockets[0].getsockname()[1]
    try:
        yield eng
    finally:
        server.close()


async def test_waiting_chunks_go_in_one_message_a_lone_one_at_once(engine: Engine) -> None:
    # Step 1: a content event alone. Step 2: three events in three writes, the middle
    # one cut inside (a piece ends mid-event). Step 3: the finish chunk, then the usage
    # event and [DONE] the router injected for (dropped by the filter).
    engine.steps = [
        [E1],
        [E2 + E3[:20], E3[20:], E4],
        [FINISH, USAGE + DONE],
    ]
    engine.go = [asyncio.Event() for _ in engine.steps]
    engine.go[0].set()
    sent: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        arrived.set()

    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    async def next_message() -> dict[str, Any]:
        await asyncio.wait_for(arrived.wait(), 5)
        arrived.clear()
        return sent[-1]

    pool = WirePool()
    try:
        response = await pool.request(
            "POST", "127.0.0.1", engine.port, "/v1/chat/completions", body=b"{}"
        )
        events = sse.StreamFilter(injected_usage=True)
        relay = asyncio.create_task(stream(response, receive, send, events.feed, events.close))
        # (b) E1 goes on while the engine holds everything else: nothing waits for company.
        assert (await next_message())["body"] == E1
        assert not engine.go[1].is_set()
        # (a) three writes, already waiting together: one message; (c) the event cut
        # between two of them reaches the client whole.
        count = len(sent)
        engine.go[1].set()
        assert (await next_message())["body"] == E2 + E3 + E4
        assert len(sent) == count + 1
        engine.go[2].set()
        await asyncio.wait_for(relay, 5)
        rest = b"".join(m["body"] for m in sent[count + 1 :])
        assert rest == FINISH + DONE  # the injected usage event is dropped
        assert sent[-1]["more_body"] is False
        assert events.usage == (5, 4)
    finally:
        await pool.close()
