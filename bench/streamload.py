"""Streaming-throughput load: C concurrent SSE streams, their chunks counted as they arrive.

    python bench/streamload.py --url http://127.0.0.1:8000/v1/chat/completions \\
        --body '{"model": "bench", ...}' --header 'Authorization: Bearer ...' \\
        --concurrency 64 --warmup 2 --duration 8

Each of ``--concurrency`` keep-alive connections sends the streamed request, reads the
answer with httptools and sends it again as soon as it ends (closed loop, as wrk). The
run has a warm-up, then a measured window, printed as one line each when it begins and
ends (``WINDOW begin`` / ``WINDOW end``) so that the caller can read the CPU of the
processes under test at those instants; chunks are counted only inside the window. A
chunk is one SSE event (``data:``) received. The last line is a JSON object: chunks,
seconds, streams completed, bytes, errors, and this process's own CPU seconds.

Loopback only, bounded in time: the connections are aborted at the end of the window
(the caller also bounds the whole run with a timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import httptools

_EVENT = b"data:"
_CARRY = len(_EVENT) - 1  # a marker cut by a read boundary is counted in the next read


class Counters:
    def __init__(self) -> None:
        self.chunks = 0
        self.bytes = 0
        self.streams = 0
        self.errors: dict[str, int] = {}
        self.first_error: str | None = None
        self.stopping = False
        self.clients: set[StreamClient] = set()

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self.first_error is None:
            self.first_error = f"{kind}: {detail}"[:300]


class StreamClient(asyncio.Protocol):
    """One connection sending the request again each time its answer ends."""

    def __init__(self, request: bytes, counters: Counters, lost: asyncio.Future[None]) -> None:
        self.request = request
        self.counters = counters
        self.lost = lost
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.carry = b""
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.counters.clients.add(self)
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.carry = b""
        self.status = 0
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.counters.bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.counters.error("parse", str(exc))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.counters.clients.discard(self)
        if not self.counters.stopping:
            self.counters.error("closed", str(exc or "EOF"))
        if not self.lost.done():
            self.lost.set_result(None)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status != 200:
            self.counters.error("status", str(self.status))

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            return
        text = self.carry + body if self.carry else body
        self.counters.chunks += text.count(_EVENT)
        self.carry = text[-_CARRY:]

    def on_message_complete(self) -> None:
        if self.status == 200:
            self.counters.streams += 1
        if self.counters.stopping or not self.parser.should_keep_alive() or self.status != 200:
            self._close()
            return
        self._send()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    body = args.body.encode()
    head = [f"POST {url.path or '/'} HTTP/1.1", f"Host: {host}:{port}"]
    head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    head += args.header
    request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
    counters = Counters()
    loop = asyncio.get_running_loop()

    async def connection() -> None:
        # A connection that ends (an error, or the server closing it) is opened again,
        # so the concurrency holds through the window.
        while not counters.stopping:
            lost: asyncio.Future[None] = loop.create_future()
            try:
                await loop.create_connection(
                    lambda lost=lost: StreamClient(request, counters, lost), host, port
                )
            except OSError as exc:
                counters.error("connect", str(exc))
                await asyncio.sleep(0.1)
                continue
            await lost

    tasks = [asyncio.create_task(connection()) for _ in range(args.concurrency)]
    await asyncio.sleep(args.warmup)
    print("WINDOW begin", flush=True)
    began = time.perf_counter()
    before = (counters.chunks, counters.bytes, counters.streams)
    errors_before = sum(counters.errors.values())
    await asyncio.sleep(args.duration)
    seconds = time.perf_counter() - began
    after = (counters.chunks, counters.bytes, counters.streams)
    print("WINDOW end", flush=True)
    counters.stopping = True
    for client in list(counters.clients):
        client._close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "chunks": after[0] - before[0],
        "bytes": after[1] - before[1],
        "streams": after[2] - before[2],
        "seconds": seconds,
        "chunks_per_s": (after[0] - before[0]) / seconds if seconds else 0.0,
        "errors": counters.errors,
        "errors_in_window": sum(counters.errors.values()) - errors_before,
        "first_error": counters.first_error,
        "client_cpu_s": usage.ru_utime + usage.ru_stime,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/streamload.py")
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True, help="the JSON body of the streamed request")
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    if not 1 <= args.concurrency <= 1024 or not 0 < args.duration <= 120:
        parser.error("--concurrency 1-1024, --duration up to 120 s")
    if not 0 <= args.warmup <= 60:
        parser.error("--warmup 0-60 s")
    if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        parser.error("--url: loopback only")
    for header in args.header:
        if ":" not in header or "\r" in header or "\n" in header:
            parser.error(f"--header: not 'Name: value': {header!r}")
    if args.loop == "uvloop":
        import uvloop

        result = uvloop.run(run(args))
    else:
        result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
