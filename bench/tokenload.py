"""Token-stream load: C concurrent chat streams, tokens per second and time to first token.

    python bench/tokenload.py --url http://127.0.0.1:8000/v1/chat/completions \\
        --body '{"model": "bench", "stream": true, "max_tokens": 64, ...}' \\
        --header 'Authorization: Bearer ...' --concurrency 64 --warmup 3 --duration 6

The same closed loop as bench/streamload.py (each of ``--concurrency`` keep-alive
connections sends the streamed request again as soon as its answer ends; the
``WINDOW begin`` / ``WINDOW end`` lines let the caller read CPU counters at those
instants), but it counts what a user of an engine sees rather than SSE events:

- a token is one event carrying text: one ``"content":"`` in the stream. llama-server
  sends one such event per token; its role chunk (``"content":null``), its finish
  chunk and the usage event carry none (bench/engine_streams.py checks that count
  against ``usage.completion_tokens`` before it measures);
- time to first token is from the request's write to the arrival of the first such
  event, kept for every request whose first token arrives inside the window.

llama-server closes its side of the connection right after every streamed answer
(without ``Connection: close``; protocol/wire.py), so the next request, sent on the
kept connection, meets a closed connection. As MirbadLLM's own pool does (D39), a
request whose reused connection closes before any byte of its answer is sent again on
a fresh connection, and its time to first token counts from its first write: the
client pays the reconnect, as the agent does in front of the same engine. Those are
counted as ``resent``, not as errors.

The connections start spread evenly over ``--spread`` seconds (default: half the
warm-up; at most the warm-up), so that streams of equal length do not all begin and
end together: about a stream's length spreads them over its whole cycle. The last line is a JSON object:
tokens, seconds, tokens per second, streams completed, the time-to-first-token
samples (ms) and their p50/p95, errors, and this process's CPU seconds in the window.

Loopback only, bounded in time: the connections are aborted at the end of the window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import httptools

_TOKEN = b'"content":"'
_CARRY = len(_TOKEN) - 1  # a marker cut by a read boundary is counted in the next read


def percentile(values: list[float], pct: float) -> float:
    """The nearest-rank percentile (as bench/_load.py); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def _number(value: bytes) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


class Window:
    """What is counted, and whether the measured window is open."""

    def __init__(self) -> None:
        self.open = False
        self.stopping = False
        self.tokens = 0
        self.streams = 0
        self.ttft_ms: list[float] = []
        # MirbadLLM's router reports its own time and its queue wait per request
        # (router/app.py); kept for the requests whose time to first token is kept.
        self.overhead_ms: list[float] = []
        self.queue_ms: list[float] = []
        self.errors: dict[str, int] = {}
        self.first_error: str | None = None
        self.clients: set[TokenClient] = set()
        self.resent = 0

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self.first_error is None:
            self.first_error = f"{kind}: {detail}"[:300]


class TokenClient(asyncio.Protocol):
    """One connection sending the request again each time its answer ends."""

    def __init__(
        self,
        request: bytes,
        window: Window,
        lost: asyncio.Future[float | None],
        first_sent: float | None,
    ) -> None:
        self.request = request
        self.window = window
        self.lost = lost
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.carry = b""
        self.status = 0
        self.sent = 0.0
        self.first = False
        self.overhead: float | None = None
        self.queue: float | None = None
        # A request resent after its reused connection closed: counted from its first write.
        self.first_sent = first_sent
        self.requests = 0
        self.pending = False  # a request written and its answer not complete
        self.received = False  # a byte of that answer arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.window.clients.add(self)
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.carry = b""
        self.status = 0
        self.first = False
        self.overhead = self.queue = None
        self.sent = time.perf_counter()
        if self.first_sent is not None:
            self.sent, self.first_sent = self.first_sent, None
        self.requests += 1
        self.pending, self.received = True, False
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.window.error("parse", str(exc))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.window.clients.discard(self)
        resend: float | None = None
        if self.window.stopping or not self.pending:
            pass  # closed between two answers: the loop opens another
        elif not self.received and self.requests > 1:
            self.window.resent += 1
            resend = self.sent
        else:
            self.window.error("closed", str(exc or "EOF"))
        if not self.lost.done():
            self.lost.set_result(resend)

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"x-mirbad-overhead-ms":
            self.overhead = _number(value)
        elif lower == b"x-mirbad-queue-ms":
            self.queue = _number(value)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status != 200:
            self.window.error("status", str(self.status))

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            return
        text = self.carry + body if self.carry else body
        found = text.count(_TOKEN)
        self.carry = text[-_CARRY:]
        if not found:
            return
        window = self.window
        if not self.first:
            self.first = True
            if window.open:
                window.ttft_ms.append((time.perf_counter() - self.sent) * 1000)
                if self.overhead is not None:
                    window.overhead_ms.append(self.overhead)
                if self.queue is not None:
                    window.queue_ms.append(self.queue)
        if window.open:
            window.tokens += found

    def on_message_complete(self) -> None:
        self.pending = False
        if self.status == 200 and self.window.open:
            self.window.streams += 1
        if self.window.stopping or not self.parser.should_keep_alive() or self.status != 200:
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
    window = Window()
    loop = asyncio.get_running_loop()
    spread = args.warmup / 2 if args.spread is None else args.spread

    async def connection(index: int) -> None:
        await asyncio.sleep(spread * index / args.concurrency)
        # A connection that ends (an error, or the server closing it) is opened again,
        # so the concurrency holds through the window.
        resend: float | None = None
        while not window.stopping:
            lost: asyncio.Future[float | None] = loop.create_future()
            try:
                await loop.create_connection(
                    lambda lost=lost, at=resend: TokenClient(request, window, lost, at),
                    host,
                    port,
                )
            except OSError as exc:
                window.error("connect", str(exc))
                await asyncio.sleep(0.1)
                resend = None
                continue
            resend = await lost

    tasks = [asyncio.create_task(connection(i)) for i in range(args.concurrency)]
    await asyncio.sleep(args.warmup)
    print("WINDOW begin", flush=True)
    errors_before = sum(window.errors.values())
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    window.open = True
    began = time.perf_counter()
    await asyncio.sleep(args.duration)
    window.open = False
    seconds = time.perf_counter() - began
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    print("WINDOW end", flush=True)
    window.stopping = True
    for client in list(window.clients):
        client._close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    samples = window.ttft_ms
    return {
        "tokens": window.tokens,
        "seconds": seconds,
        "tokens_per_s": window.tokens / seconds if seconds else 0.0,
        "streams": window.streams,
        "ttft_count": len(samples),
        "ttft_p50_ms": percentile(samples, 50),
        "ttft_p95_ms": percentile(samples, 95),
        "ttft_mean_ms": statistics.fmean(samples) if samples else float("nan"),
        "ttft_ms": [round(x, 3) for x in samples],
        "router_overhead_p50_ms": percentile(window.overhead_ms, 50)
        if window.overhead_ms
        else None,
        "router_queue_p50_ms": percentile(window.queue_ms, 50) if window.queue_ms else None,
        "router_queue_max_ms": max(window.queue_ms) if window.queue_ms else None,
        "resent": window.resent,
        "errors": window.errors,
        "errors_in_window": sum(window.errors.values()) - errors_before,
        "first_error": window.first_error,
        "client_cpu_s": (cpu_after.ru_utime - cpu_before.ru_utime)
        + (cpu_after.ru_stime - cpu_before.ru_stime),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/tokenload.py")
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True, help="the JSON body of the streamed request")
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--spread", type=float, help="seconds over which connections start")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    if not 1 <= args.concurrency <= 1024 or not 0 < args.duration <= 120:
        parser.error("--concurrency 1-1024, --duration up to 120 s")
    if not 0 <= args.warmup <= 60:
        parser.error("--warmup 0-60 s")
    if args.spread is not None and not 0 <= args.spread <= args.warmup:
        parser.error("--spread: 0 to the warm-up")
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
