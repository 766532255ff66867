"""The pre-authentication attacks of issue 11, as raw-socket clients, for every listener.

Each listener's tests (web, enroll, agent) send the same bytes and expect the same
answers (docs/operator-guide.md, "Limits"); the memory check runs the listener in a
subprocess of its own (tests/limits_server.py) and watches its RSS with psutil.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent

BIG_HEADER = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8_000_000 + b"\r\n\r\n"
MANY_HEADERS = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200_000 + b"\r\n"
# Under the byte limit (about 2 KiB) but over the count limit.
COUNTED_HEADERS = (
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(150)) + b"\r\n"
)
UNTERMINATED_MIB = 16  # per connection
UNTERMINATED_CONNECTIONS = 16


def request(path: str = "/", host: str = "x") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    got = bytearray()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        while chunk := await reader.read(65536):
            got += chunk
    return bytes(got)


async def exchange(
    port: int,
    data: bytes,
    *,
    context: ssl.SSLContext | None = None,
    timeout: float = 10.0,
) -> bytes:
    """Send ``data`` (while reading, tolerating the server's close) and return every
    byte the server sent until it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)

    async def send() -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError, RuntimeError):
            for start in range(0, len(data), 1 << 20):
                writer.write(data[start : start + (1 << 20)])
                await writer.drain()

    sender = asyncio.create_task(send())
    try:
        return await asyncio.wait_for(_read_all(reader), timeout)
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        writer.close()


async def closed_within(
    port: int, data: bytes, seconds: float, *, context: ssl.SSLContext | None = None
) -> tuple[float, bytes]:
    """Send ``data`` and keep the connection open; how long until the server closes it,
    and what it answered. Raises TimeoutError when it stays open past ``seconds``."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(_read_all(reader), seconds)
        return time.monotonic() - started, answer
    finally:
        writer.close()


def status_of(answer: bytes) -> int | None:
    if not answer.startswith(b"HTTP/1.1 "):
        return None
    return int(answer[9:12])


# -- memory: the unterminated-headers attack on a listener in its own process --------


@contextlib.contextmanager
def limits_server(kind: str, env: dict[str, str] | None = None) -> Iterator[tuple[int, int]]:
    """Run tests/limits_server.py ``kind``; yields (pid, port)."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "limits_server.py"), kind],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("port "), f"limits_server {kind} did not start: {line!r}"
        yield process.pid, int(line.split()[1])
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


async def _unterminated(port: int, mib: int) -> None:
    """One connection sending a header value of ``mib`` MiB that never ends."""
    with contextlib.suppress(ConnectionError, OSError):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
            block = b"a" * (1 << 20)
            for _ in range(mib):
                writer.write(block)
                await asyncio.wait_for(writer.drain(), 5)
            await asyncio.wait_for(reader.read(65536), 5)
        except TimeoutError:
            pass  # the server stopped reading: what it holds is what we measure
        finally:
            writer.close()


async def rss_growth_under_unterminated_headers(pid: int, port: int) -> int:
    """Peak growth of ``pid``'s RSS, in bytes, while 16 connections each send a 16 MiB
    header that never ends."""
    process = psutil.Process(pid)
    await asyncio.sleep(0.5)
    baseline = process.memory_info().rss
    peak = baseline
    attack = asyncio.gather(
        *(_unterminated(port, UNTERMINATED_MIB) for _ in range(UNTERMINATED_CONNECTIONS))
    )
    while not attack.done():
        peak = max(peak, process.memory_info().rss)
        await asyncio.sleep(0.02)
    await attack
    await asyncio.sleep(0.3)
    peak = max(peak, process.memory_info().rss)
    return peak - baseline


# -- slowloris, run as ``python tests/http_attacks.py slowloris PORT COUNT SECONDS`` ------


async def slowloris(port: int, count: int, seconds: float) -> dict[str, Any]:
    """``count`` connections that each send a request head one header line a second,
    reopened whenever the server closes one (what an attacker does), for ``seconds``.

    Prints ``open N`` once all are open; returns what the server did to them.
    """
    stats: dict[str, Any] = {"open": 0, "minOpen": count, "closed": 0, "answers": {}}
    lifetimes: list[float] = []
    stop = asyncio.Event()

    async def one() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            opened = time.monotonic()
            stats["open"] += 1
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                line = 0
                while not stop.is_set():
                    try:
                        answer = await asyncio.wait_for(reader.read(1024), 1.0)
                    except TimeoutError:
                        writer.write(b"X-Slow-%d: y\r\n" % line)
                        line += 1
                        continue
                    status = str(status_of(answer))
                    stats["answers"][status] = stats["answers"].get(status, 0) + 1
                    stats["closed"] += 1
                    lifetimes.append(time.monotonic() - opened)
                    break
            except (ConnectionError, OSError):
                stats["closed"] += 1
                lifetimes.append(time.monotonic() - opened)
            finally:
                stats["open"] -= 1
                writer.close()

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    while stats["open"] < count:
        await asyncio.sleep(0.01)
    print(f"open {stats['open']}", flush=True)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        await asyncio.sleep(0.05)
        # Reopening takes a moment: the lowest count over a 0.5 s window is what was held.
        stats.setdefault("samples", []).append(stats["open"])
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    samples = stats.pop("samples")
    stats["minOpen"] = min(max(samples[i : i + 10]) for i in range(0, len(samples) - 9))
    stats["medianLifetime"] = round(statistics.median(lifetimes), 2) if lifetimes else None
    return stats


if __name__ == "__main__":
    if sys.argv[1] == "slowloris":
        result = asyncio.run(slowloris(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
        print(json.dumps(result), flush=True)
