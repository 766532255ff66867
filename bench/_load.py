"""Load generation: wrk for non-streamed requests, an aiohttp client for streams, and
bench/streamload.py for streaming throughput (many concurrent long streams).

wrk runs a Lua script that sets the POST body and headers and, in ``done``, prints one
``BENCH {...}`` line with the request count, the error counters and the latency
percentiles (p50/p90/p95/p99, microseconds) that the plain ``--latency`` output lacks.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

CHAT_PATH = "/v1/chat/completions"
STREAM_TOKENS = 16

_LUA_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH {\"requests\":%d,\"duration_us\":%d,\"bytes\":%d,\"connect\":%d,\"read\":%d," ..
    "\"write\":%d,\"status\":%d,\"timeout\":%d,\"p50\":%d,\"p90\":%d,\"p95\":%d," ..
    "\"p99\":%d,\"mean\":%.1f,\"max\":%d}\n",
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(95),
    latency:percentile(99), latency.mean, latency.max))
end
"""


def chat_body(model: str, *, stream: bool, chunk_ms: float | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": STREAM_TOKENS,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if chunk_ms:
            body["x_stub_chunk_ms"] = chunk_ms  # the stub's pace; see bench/stub_engine.py
    return body


def write_lua(path: Path, *, body: dict[str, Any], headers: dict[str, str]) -> Path:
    text = json.dumps(body, separators=(",", ":"))
    if "]]" in text:
        raise ValueError("the body must not contain ']]' (a Lua long bracket)")
    lines = ['wrk.method = "POST"', f"wrk.body = [[{text}]]"]
    for name, value in {"Content-Type": "application/json", **headers}.items():
        lines.append(f"wrk.headers[{json.dumps(name)}] = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n" + _LUA_DONE)
    return path


@dataclass
class WrkResult:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    errors: dict[str, int]
    wrk_cpu_s: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_wrk(
    wrk: str, url: str, script: Path, *, connections: int, seconds: float, timeout_s: float = 30.0
) -> WrkResult:
    threads = 1 if connections == 1 else 2
    argv = [
        wrk,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        f"--timeout={int(timeout_s)}s",
        "-s",
        str(script),
        url,
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=seconds + timeout_s + 30, check=False
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(
            f"wrk exited {done.returncode} without a result: {(done.stdout + done.stderr)[-800:]}"
        )
    data = json.loads(line[6:])
    secs = data["duration_us"] / 1e6
    errors = {k: data[k] for k in ("connect", "read", "write", "status", "timeout") if data[k]}
    return WrkResult(
        requests=data["requests"],
        seconds=secs,
        rps=data["requests"] / secs if secs else 0.0,
        p50_ms=data["p50"] / 1000,
        p90_ms=data["p90"] / 1000,
        p95_ms=data["p95"] / 1000,
        p99_ms=data["p99"] / 1000,
        mean_ms=data["mean"] / 1000,
        max_ms=data["max"] / 1000,
        errors=errors,
        wrk_cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    )


# -- streams ---------------------------------------------------------------------------


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class StreamResult:
    count: int
    ttfc_p50_ms: float
    ttfc_p95_ms: float
    ttfc_mean_ms: float
    total_p50_ms: float
    events_median: float
    failures: int
    first_failure: str | None
    overhead_header_p50_ms: float | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def _one_stream(
    session: aiohttp.ClientSession, url: str, payload: bytes, headers: dict[str, str]
) -> tuple[float, float, int, float | None]:
    started = time.perf_counter()
    first: float | None = None
    buffer = b""
    async with session.post(url, data=payload, headers=headers) as response:
        if response.status != 200:
            text = (await response.read())[:300]
            raise RuntimeError(f"status {response.status}: {text!r}")
        overhead = response.headers.get("x-mirbad-overhead-ms")
        while True:
            chunk = await response.content.readany()
            if not chunk:
                break
            if first is None and b"data:" in (buffer + chunk):
                first = time.perf_counter()
            buffer += chunk
    ended = time.perf_counter()
    if first is None or b"data: [DONE]" not in buffer:
        raise RuntimeError(f"the stream did not end with data: [DONE]: {buffer[-200:]!r}")
    return (
        first - started,
        ended - started,
        buffer.count(b"data:"),
        (float(overhead) if overhead else None),
    )


async def _streams(
    url: str, headers: dict[str, str], model: str, count: int, warmup: int, chunk_ms: float | None
) -> StreamResult:
    payload = json.dumps(chat_body(model, stream=True, chunk_ms=chunk_ms)).encode()
    headers = {"Content-Type": "application/json", **headers}
    connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=30)
    ttfc: list[float] = []
    total: list[float] = []
    events: list[int] = []
    overheads: list[float] = []
    failures = 0
    first_failure: str | None = None
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        for index in range(warmup + count):
            try:
                first, whole, n, overhead = await _one_stream(session, url, payload, headers)
            except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
                failures += 1
                first_failure = first_failure or f"{type(exc).__name__}: {exc}"
                if failures > 5 and not ttfc:
                    break
                continue
            if index >= warmup:
                ttfc.append(first * 1000)
                total.append(whole * 1000)
                events.append(n)
                if overhead is not None:
                    overheads.append(overhead)
    return StreamResult(
        count=len(ttfc),
        ttfc_p50_ms=_percentile(ttfc, 50),
        ttfc_p95_ms=_percentile(ttfc, 95),
        ttfc_mean_ms=statistics.fmean(ttfc) if ttfc else float("nan"),
        total_p50_ms=_percentile(total, 50),
        events_median=statistics.median(events) if events else float("nan"),
        failures=failures,
        first_failure=first_failure,
        overhead_header_p50_ms=_percentile(overheads, 50) if overheads else None,
    )


def run_streams(
    url: str,
    headers: dict[str, str],
    *,
    model: str,
    count: int,
    warmup: int = 20,
    chunk_ms: float | None = None,
) -> StreamResult:
    """``count`` sequential streamed requests on one keep-alive connection.

    ``chunk_ms`` asks the stub to space its chunks (a token rate); None: back to back.
    """
    return asyncio.run(_streams(url, headers, model, count, warmup, chunk_ms))


async def _check(url: str, headers: dict[str, str], model: str) -> str | None:
    """None when one plain and one streamed request answer as the stub does."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, json=chat_body(model, stream=False), headers=headers) as r:
            text = await r.text()
            if r.status != 200:
                return f"POST {url}: status {r.status}: {text[:300]}"
            try:
                data = json.loads(text)
                content = data["choices"][0]["message"]["content"]
                data["usage"]["total_tokens"]
            except (ValueError, KeyError, IndexError, TypeError):
                return f"POST {url}: unexpected answer {text[:300]}"
            if "benchmark stub" not in content:
                return f"POST {url}: the answer is not the stub's: {text[:300]}"
        try:
            await _one_stream(
                session,
                url,
                json.dumps(chat_body(model, stream=True)).encode(),
                {"Content-Type": "application/json", **headers},
            )
        except (aiohttp.ClientError, RuntimeError) as exc:
            return f"streamed POST {url}: {exc}"
    return None


def check_path(url: str, headers: dict[str, str], *, model: str) -> str | None:
    return asyncio.run(_check(url, headers, model))


# -- streaming throughput ---------------------------------------------------------------

# Chunks per stream of the throughput point: long enough that a stream's request costs
# next to nothing per chunk, short enough that streams end and start again during a point.
THROUGHPUT_CHUNKS = 1000
_STREAMLOAD = Path(__file__).resolve().parent / "streamload.py"


def throughput_body(model: str, chunks: int = THROUGHPUT_CHUNKS) -> dict[str, Any]:
    """A streamed request for ``chunks`` chunks sent back to back (the stub's
    ``x_stub_chunks``), without ``stream_options``: what most clients send, so MirbadLLM's
    router adds ``include_usage`` and filters the stream, its costlier case."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
        "stream": True,
        "x_stub_chunks": chunks,
    }


def run_stream_load(
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    *,
    concurrency: int,
    warmup: float,
    seconds: float,
    on_begin: Callable[[], None],
    on_end: Callable[[], None],
    python: str,
    script: Path = _STREAMLOAD,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run bench/streamload.py; ``on_begin``/``on_end`` are called as its measured
    window begins and ends (to read CPU counters then). Returns its JSON result.

    ``script``: another load generator with the same arguments and output lines
    (bench/tokenload.py); ``extra``: more arguments for it."""
    argv = [
        python,
        str(script),
        "--url",
        url,
        "--body",
        json.dumps(body, separators=(",", ":")),
        "--concurrency",
        str(concurrency),
        "--warmup",
        f"{warmup:g}",
        "--duration",
        f"{seconds:g}",
    ]
    for name, value in headers.items():
        argv += ["--header", f"{name}: {value}"]
    argv += extra
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    )
    deadline = time.monotonic() + warmup + seconds + 60
    timer = threading.Timer(max(1.0, deadline - time.monotonic()), proc.kill)
    timer.start()
    last = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if line == "WINDOW begin":
                on_begin()
            elif line == "WINDOW end":
                on_end()
            elif line:
                last = line
        proc.wait()
        stderr = proc.stderr.read() if proc.stderr is not None else ""
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not last.startswith("{"):
        raise RuntimeError(
            f"streamload exited {proc.returncode} without a result: {(last + stderr)[-800:]}"
        )
    result: dict[str, Any] = json.loads(last)
    return result
