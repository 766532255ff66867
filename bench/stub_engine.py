"""A fast stub OpenAI upstream that the MirbadLLM agent can launch as ``llama-server``.

It takes llama-server's arguments (``--host``, ``--port``, ``--alias``; everything
else is accepted and ignored) and answers, on HTTP/1.1 with keep-alive:

- ``GET /health``: 200 ``{"status":"ok"}``;
- ``GET /v1/models``: the alias, only with ``Authorization: Bearer $LLAMA_API_KEY``
  (when that variable is set), as llama-server does: the agent's Ready check;
- ``POST /v1/chat/completions`` and ``/v1/completions``: without ``"stream": true`` a
  fixed JSON answer with a usage block; with it, ``max_tokens`` (default 16, at most
  1024) fixed SSE chunks, one HTTP chunk and one write each, then a usage chunk when
  ``stream_options.include_usage`` is true, then ``data: [DONE]``. The chunks go out
  back to back, or ``x_stub_chunk_ms`` apart when the body sets that (a token rate).
  ``x_stub_chunks`` (1 to 100,000) sets the number of chunks instead of
  ``max_tokens``: the long streams of the streaming-throughput point. Back to back
  means one write per chunk and a turn of the event loop between two: every stream
  of the stub gets one chunk out per turn, as an engine decoding all its slots at
  once sends one token per stream per step.

Engine slots, only when asked for (``--stub-slots``; the agent passes no such flag,
so bench/fair_queue.py launches the stub through a wrapper script that adds it): then the
stub honours llama-server's own ``-np N``/``--parallel N`` (4, llama-server's
automatic value, when absent) and works on at most N completions at once; the others
wait inside it, first in first out, as llama-server defers the tasks beyond its
slots. A completion's service time is its chunks, ``x_stub_chunk_ms``
apart (a non-streamed answer then waits as long before it is sent). A client that
disconnects while its completion waits leaves the line. Without the flag every
completion is served at once, as before (bench/router.py relies on that).

- ``GET /stub/stats``: the slot limit (null without the flag), the completions
  processing and waiting now, the most held at once (processing plus waiting) and the
  most processing at once since the last reset, the completions served, and the
  slot-seconds in use (``busy_slot_seconds``) over the ``seconds`` since the reset;
- ``POST /stub/stats/reset``: the same, then the maxima restart from what is held now.

Nothing is computed per request beyond parsing the JSON body, so the stub is the same
constant cost behind every path the benchmark compares. It is a raw asyncio protocol
with httptools' parser on uvloop (both pinned in requirements.txt); it runs with the
interpreter named in its first line and needs nothing else of the project.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools

DEFAULT_CHUNKS = 16
MAX_CHUNKS = 1024
PROMPT_TOKENS = 12
# A request field (ignored by real engines) for the time between chunks in ms; absent,
# the chunks go out back to back, each in its own write.
PACE_FIELD = "x_stub_chunk_ms"
# A request field for the number of chunks, above max_tokens' cap: a long stream whose
# cost is its chunks, not its request.
CHUNKS_FIELD = "x_stub_chunks"
MAX_LONG_CHUNKS = 100_000
# Engine slots (see the module's docstring): off unless this flag asks for them.
SLOTS_FLAG = "--stub-slots"
AUTO_SLOTS = 4  # llama-server's value for -np when it is not given

_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found"}


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


class Answers:
    """The fixed bodies, built once."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.health = _json({"status": "ok"})
        self.models = _json(
            {
                "object": "list",
                "data": [{"id": alias, "object": "model", "created": 0, "owned_by": "stub"}],
            }
        )
        created = int(time.time())
        self.chat = _json(
            {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "created": created,
                "model": alias,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": "This is a fixed answer from the benchmark stub.",
                        },
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": 10,
                    "total_tokens": PROMPT_TOKENS + 10,
                },
            }
        )
        self.completion = _json(
            {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": created,
                "model": alias,
                "choices": [{"index": 0, "text": "A fixed answer.", "finish_reason": "stop"}],
                "usage": {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": 4,
                    "total_tokens": PROMPT_TOKENS + 4,
                },
            }
        )
        base = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": created,
            "model": alias,
        }
        self.first = self._event(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": "tok"},
                        "finish_reason": None,
                    }
                ],
            }
        )
        self.middle = self._event(
            {**base, "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
        )
        self.last = self._event(
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        )
        self.base = base
        self.done = self._chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    @staticmethod
    def _chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def _event(self, data: dict[str, Any]) -> bytes:
        return self._chunk(b"data: " + _json(data) + b"\n\n")

    def usage(self, tokens: int) -> bytes:
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": tokens,
            "total_tokens": PROMPT_TOKENS + tokens,
        }
        return self._event({**self.base, "choices": [], "usage": usage})


class Slots:
    """The engine's slots: at most ``limit`` completions at once (None: no limit), the
    rest wait in arrival order; and the most ever held, for ``/stub/stats``."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.active = 0
        self.waiting: deque[Callable[[], None]] = deque()
        self.max_held = 0
        self.max_active = 0
        self.served = 0
        # Slot-seconds in use since the reset: the engine's utilization, and with it
        # how long slots sat empty between two completions.
        self.busy = 0.0
        self.since = self.changed = time.monotonic()

    def _account(self) -> None:
        now = time.monotonic()
        self.busy += self.active * (now - self.changed)
        self.changed = now

    def enter(self, start: Callable[[], None]) -> None:
        """Run ``start`` now if a slot is free, else when one frees (FIFO)."""
        if self.limit is None or self.active < self.limit:
            self.take()
            start()
        else:
            self.waiting.append(start)
            self.max_held = max(self.max_held, self.active + len(self.waiting))

    def take(self) -> None:
        """A completion starts now (a slot is free, or there is no limit)."""
        self._account()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.max_held = max(self.max_held, self.active + len(self.waiting))

    def drop(self, start: Callable[[], None]) -> None:
        """A waiting completion whose client left: out of the line."""
        try:
            self.waiting.remove(start)
        except ValueError:
            pass

    def leave(self) -> None:
        """A completion ended: its slot goes to the head of the line."""
        self._account()
        self.active -= 1
        self.served += 1
        if self.waiting and (self.limit is None or self.active < self.limit):
            start = self.waiting.popleft()
            self.take()
            start()

    def stats(self) -> dict[str, Any]:
        self._account()
        return {
            "limit": self.limit,
            "processing": self.active,
            "waiting": len(self.waiting),
            "max_held": self.max_held,
            "max_processing": self.max_active,
            "served": self.served,
            "busy_slot_seconds": round(self.busy, 6),
            "seconds": round(self.changed - self.since, 6),
        }

    def reset(self) -> dict[str, Any]:
        before = self.stats()
        self.max_held = self.active + len(self.waiting)
        self.max_active = self.active
        self.served = 0
        self.busy = 0.0
        self.since = self.changed
        return before


class Request:
    __slots__ = ("auth", "body", "keep_alive", "method", "url")

    def __init__(self) -> None:
        self.url = b""
        self.method = b""
        self.auth = b""
        self.body: list[bytes] = []
        self.keep_alive = True


class StubProtocol(asyncio.Protocol):
    def __init__(self, answers: Answers, key: bytes | None, slots: Slots) -> None:
        self.answers = answers
        self.key = key
        self.slots = slots
        self.waiting: Callable[[], None] | None = None  # this connection's place in line
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current = Request()
        self.queue: deque[Request] = deque()
        self.streaming = False

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close()
        except httptools.HttpParserError:
            self._respond(400, b'{"error":"bad request"}', keep_alive=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.waiting is not None:
            self.slots.drop(self.waiting)
            self.waiting = None

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.current = Request()

    def on_url(self, url: bytes) -> None:
        self.current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.current.auth = value

    def on_headers_complete(self) -> None:
        self.current.method = self.parser.get_method()
        self.current.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.current.body.append(body)

    def on_message_complete(self) -> None:
        self.queue.append(self.current)
        if not self.streaming:
            self._drain()

    # -- answering ----------------------------------------------------------------------

    def _drain(self) -> None:
        while self.queue and not self.streaming and self.transport is not None:
            self._handle(self.queue.popleft())

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def _respond(
        self,
        status: int,
        body: bytes,
        *,
        keep_alive: bool,
        content_type: bytes = b"application/json",
    ) -> None:
        if self.transport is None:
            return
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status,
            _REASONS.get(status, b"OK"),
            content_type,
            len(body),
            b"" if keep_alive else b"Connection: close\r\n",
        )
        self.transport.write(head + body)
        if not keep_alive:
            self._close()

    def _handle(self, req: Request) -> None:
        path = req.url.split(b"?", 1)[0]
        answers = self.answers
        if req.method == b"GET" and path == b"/health":
            self._respond(200, answers.health, keep_alive=req.keep_alive)
        elif req.method == b"GET" and path == b"/v1/models":
            if self.key is not None and req.auth != b"Bearer " + self.key:
                self._respond(
                    401, b'{"error":{"message":"Invalid API Key"}}', keep_alive=req.keep_alive
                )
            else:
                self._respond(200, answers.models, keep_alive=req.keep_alive)
        elif req.method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                data = json.loads(b"".join(req.body) or b"{}")
                if not isinstance(data, dict):
                    raise ValueError
            except ValueError:
                self._respond(
                    400, b'{"error":{"message":"invalid JSON"}}', keep_alive=req.keep_alive
                )
                return
            # Busy until the completion ends, waiting for a slot included: the next
            # request on this connection is read after it.
            self.streaming = True
            if self.slots.limit is None:
                # No slots: at once, as before (what bench/router.py measures against).
                self.slots.take()
                self._complete(req, path, data, drain=False)
                return

            def start() -> None:
                self.waiting = None
                self._complete(req, path, data)

            self.waiting = start
            self.slots.enter(start)
        elif path == b"/stub/stats":
            if req.method == b"GET":
                self._respond(200, _json(self.slots.stats()), keep_alive=req.keep_alive)
            else:
                self._respond(404, b'{"error":{"message":"not found"}}', keep_alive=req.keep_alive)
        elif req.method == b"POST" and path == b"/stub/stats/reset":
            self._respond(200, _json(self.slots.reset()), keep_alive=req.keep_alive)
        else:
            self._respond(404, b'{"error":{"message":"not found"}}', keep_alive=req.keep_alive)

    def _complete(
        self, req: Request, path: bytes, data: dict[str, Any], *, drain: bool = True
    ) -> None:
        """A completion, once it holds a slot; the slot is left when it ends.
        ``drain=False`` when called from ``_drain``, which goes on by itself."""
        if self.transport is None:  # gone meanwhile
            self._done(drain=drain)
            return
        if data.get("stream") is True:
            self._stream(req, data)
            return
        body = self.answers.chat if path == b"/v1/chat/completions" else self.answers.completion
        if self.slots.limit is None:
            self._respond(200, body, keep_alive=req.keep_alive)
            self._done(drain=drain)
            return
        tokens, pace = _shape(data)
        asyncio.get_running_loop().create_task(
            self._send_later(req.keep_alive, body, (tokens - 1) * pace)
        )

    async def _send_later(self, keep_alive: bool, body: bytes, delay: float) -> None:
        """A non-streamed answer after its generation time (slot mode only)."""
        try:
            await asyncio.sleep(delay)
            self._respond(200, body, keep_alive=keep_alive)
        finally:
            self._done()

    def _done(self, *, drain: bool = True) -> None:
        self.slots.leave()
        self.streaming = False
        if drain and self.transport is not None:
            self._drain()

    def _stream(self, req: Request, data: dict[str, Any]) -> None:
        tokens, pace = _shape(data)
        options = data.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        self.streaming = True
        asyncio.get_running_loop().create_task(
            self._send_stream(req.keep_alive, tokens, usage, pace)
        )

    async def _send_stream(self, keep_alive: bool, tokens: int, usage: bool, pace: float) -> None:
        answers = self.answers
        try:
            if self.transport is None:
                return
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\n%s\r\n"
                % (b"" if keep_alive else b"Connection: close\r\n")
                + answers.first
            )
            for _ in range(tokens - 2):
                await asyncio.sleep(pace)  # a write per chunk, as an engine produces them
                if self.transport is None:
                    return
                self.transport.write(answers.middle)
            await asyncio.sleep(pace)
            if self.transport is None:
                return
            tail = answers.last if tokens > 1 else b""
            if usage:
                tail += answers.usage(tokens)
            self.transport.write(tail + answers.done)
            if not keep_alive:
                self._close()
        finally:
            self._done()


def _shape(data: dict[str, Any]) -> tuple[int, float]:
    """A completion's chunks and the seconds between two of them."""
    tokens = data.get("max_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        tokens = DEFAULT_CHUNKS
    tokens = min(tokens, MAX_CHUNKS)
    long = data.get(CHUNKS_FIELD)
    if isinstance(long, int) and not isinstance(long, bool) and 1 <= long <= MAX_LONG_CHUNKS:
        tokens = long
    gap = data.get(PACE_FIELD)
    pace = gap / 1000 if isinstance(gap, int | float) and 0 < gap <= 1000 else 0.0
    return tokens, pace


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stub-engine", allow_abbrev=False, add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", "-a", default="stub")
    parser.add_argument("--version", action="store_true")
    parser.add_argument("-np", "--parallel", type=int, default=None)
    parser.add_argument(SLOTS_FLAG, action="store_true", dest="stub_slots")
    args, _ignored = parser.parse_known_args(argv)
    return args


def slot_limit(args: argparse.Namespace) -> int | None:
    """The engine's slots when asked for (see the module's docstring), else None."""
    if not args.stub_slots:
        return None
    return args.parallel if args.parallel is not None and args.parallel >= 1 else AUTO_SLOTS


async def serve(args: argparse.Namespace) -> None:
    key = os.environ.get("LLAMA_API_KEY")
    answers = Answers(args.alias)
    slots = Slots(slot_limit(args))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: StubProtocol(answers, key.encode() if key else None, slots),
        host=args.host,
        port=args.port,
        backlog=1024,
        reuse_address=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    limit = f", {slots.limit} slots" if slots.limit is not None else ""
    print(f"stub engine: listening on {args.host}:{args.port} as {args.alias!r}{limit}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        print("version: bench-stub-1 (stub)", flush=True)
        return 0
    args = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
