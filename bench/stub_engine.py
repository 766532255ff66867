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


class Request:
    __slots__ = ("auth", "body", "keep_alive", "method", "url")

    def __init__(self) -> None:
        self.url = b""
        self.method = b""
        self.auth = b""
        self.body: list[bytes] = []
        self.keep_alive = True


class StubProtocol(asyncio.Protocol):
    def __init__(self, answers: Answers, key: bytes | None) -> None:
        self.answers = answers
        self.key = key
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
            if data.get("stream") is True:
                self._stream(req, data)
            elif path == b"/v1/chat/completions":
                self._respond(200, answers.chat, keep_alive=req.keep_alive)
            else:
                self._respond(200, answers.completion, keep_alive=req.keep_alive)
        else:
            self._respond(404, b'{"error":{"message":"not found"}}', keep_alive=req.keep_alive)

    def _stream(self, req: Request, data: dict[str, Any]) -> None:
        tokens = data.get("max_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            tokens = DEFAULT_CHUNKS
        tokens = min(tokens, MAX_CHUNKS)
        long = data.get(CHUNKS_FIELD)
        if isinstance(long, int) and not isinstance(long, bool) and 1 <= long <= MAX_LONG_CHUNKS:
            tokens = long
        options = data.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        gap = data.get(PACE_FIELD)
        pace = gap / 1000 if isinstance(gap, int | float) and 0 < gap <= 1000 else 0.0
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
            self.streaming = False
            if self.transport is not None:
                self._drain()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stub-engine", allow_abbrev=False, add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", "-a", default="stub")
    parser.add_argument("--version", action="store_true")
    args, _ignored = parser.parse_known_args(argv)
    return args


async def serve(args: argparse.Namespace) -> None:
    key = os.environ.get("LLAMA_API_KEY")
    answers = Answers(args.alias)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: StubProtocol(answers, key.encode() if key else None),
        host=args.host,
        port=args.port,
        backlog=1024,
        reuse_address=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub engine: listening on {args.host}:{args.port} as {args.alias!r}", flush=True)
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
