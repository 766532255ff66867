"""Issue 11's listener limits on the real stack (``./mirbad up``): 500 slowloris
connections held open (reopened as the head deadline closes them) while normal
requests run, and the oversized head answered 431 on the web and enroll ports."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http_attacks import BIG_HEADER, exchange, status_of

pytestmark = pytest.mark.slow

SLOW_CONNECTIONS = 500
PHASE_SECONDS = 12.0  # longer than the 10 s head deadline: every slow connection is cut once
ROOT = Path(__file__).resolve().parents[2]


class Slowloris:
    """tests/http_attacks.py's slowloris in a process of its own, so that its work does
    not slow the measuring client down (one GIL) and count as the server's."""

    def __init__(self, port: int, count: int, seconds: float) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "http_attacks.py"),
                "slowloris",
                str(port),
                str(count),
                str(seconds),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.opened = int(self.process.stdout.readline().split()[1])  # "open N"

    def result(self) -> dict[str, Any]:
        out, _ = self.process.communicate(timeout=60)
        return json.loads(out)


def latencies(url: str, seconds: float) -> list[float]:
    """Sequential GETs for ``seconds``, each on a new connection; seconds each."""
    out = []
    until = time.monotonic() + seconds
    with httpx.Client(timeout=30, headers={"Connection": "close"}) as client:
        while time.monotonic() < until:
            started = time.perf_counter()
            response = client.get(url)
            out.append(time.perf_counter() - started)
            assert response.status_code in (200, 503), response.text
    return out


def p(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)
    )


def test_slowloris_does_not_slow_normal_requests_and_big_heads_are_431(make_stack) -> None:
    stack = make_stack(embedded=True)
    stack.start()
    url = f"{stack.url}/healthz"
    latencies(url, 1.0)  # warm-up
    unloaded = latencies(url, PHASE_SECONDS)
    attack = Slowloris(stack.port, SLOW_CONNECTIONS, PHASE_SECONDS + 1.0)
    loaded = latencies(url, PHASE_SECONDS)
    seen = attack.result()

    u50, u99 = p(unloaded, 50), p(unloaded, 99)
    l50, l99 = p(loaded, 50), p(loaded, 99)
    print(
        f"\n/healthz unloaded: p50 {u50 * 1000:.1f} ms, p99 {u99 * 1000:.1f} ms ({len(unloaded)})"
        f"\n/healthz with {attack.opened} slow connections open: p50 {l50 * 1000:.1f} ms, "
        f"p99 {l99 * 1000:.1f} ms ({len(loaded)})\nslowloris: {seen}"
    )
    assert attack.opened == SLOW_CONNECTIONS
    assert seen["minOpen"] >= SLOW_CONNECTIONS * 0.9, seen  # held open throughout
    # What this guards against is a request queued behind the held connections: it
    # waits for their 10 s head deadline. So the bound is far from any scheduling
    # hiccup (a p99 of a few ms against a quiet one measured beside it failed CI on
    # shared cores twice): no request waited a tenth of that deadline, and the median
    # stayed within 50 ms of the quiet one. How fast /healthz is, is bench/'s question.
    assert max(loaded) < 1.0, (u99, l99, max(loaded))
    assert l50 <= u50 + 0.050, (u50, l50)
    # The 10 s head deadline cut them (408), not something sooner or later.
    assert seen["closed"] >= SLOW_CONNECTIONS * 0.9, seen
    assert seen["answers"].get("408", 0) >= seen["closed"] * 0.9, seen
    assert 9.5 < seen["medianLifetime"] < 12.5, seen

    # The oversized head, on the web port and on the enroll listener (TLS).
    answer = asyncio.run(exchange(stack.port, BIG_HEADER))
    assert status_of(answer) == 431, answer[:200]
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    tls.check_hostname = False
    tls.verify_mode = ssl.CERT_NONE
    enroll_port = int(stack.env["MIRBAD_ENROLL_PORT"])
    answer = asyncio.run(exchange(enroll_port, BIG_HEADER, context=tls))
    assert status_of(answer) == 431, answer[:200]
    with socket.create_connection(("127.0.0.1", stack.port), timeout=5):
        pass  # the web port still takes connections after all this
