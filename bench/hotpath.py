"""Micro-benchmark of the router's per-request helpers: µs per call (not a test).

Run: ``.venv/bin/python bench/hotpath.py``. The router's added-latency target is about
1.3 ms per request in all; these are the pieces of it that this repository's
transform and metrics modules add.
"""

from __future__ import annotations

import json
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from router.metrics import Metrics
from router.sse import StreamFilter, UsageSniffer
from router.transform import prepare

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "router" / "fixtures"


def _chat_body(stream: bool) -> tuple[bytes, dict[str, object]]:
    data: dict[str, object] = {
        "model": "qwen3-8b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. " * 20},
            {"role": "user", "content": "Summarise the following text. " + "lorem ipsum " * 150},
        ],
        "temperature": 0.7,
        "max_tokens": 512,
        "stream": stream,
    }
    body = json.dumps(data).encode()
    return body, json.loads(body)


def _time(label: str, fn: Callable[[], object], number: int = 20_000) -> None:
    best = min(timeit.repeat(fn, number=number, repeat=5)) / number
    print(f"{label:<58} {best * 1e6:8.2f} µs")


def main() -> None:
    plain, plain_data = _chat_body(stream=False)
    streamed, streamed_data = _chat_body(stream=True)
    print(f"chat body: {len(plain)} bytes")
    _time(
        "prepare, non-stream chat, parsed dict passed",
        lambda: prepare("/v1/chat/completions", plain, emulate_dimensions=False, data=plain_data),
    )
    _time(
        "prepare, stream chat (include_usage spliced), dict passed",
        lambda: prepare(
            "/v1/chat/completions", streamed, emulate_dimensions=False, data=streamed_data
        ),
    )
    _time(
        "prepare, embeddings without dimensions, no dict",
        lambda: prepare("/v1/embeddings", plain, emulate_dimensions=True),
    )
    _time("json.loads of the same body (for scale)", lambda: json.loads(streamed))

    events = [
        e + b"\n\n"
        for e in (FIXTURES / "llamacpp_chat_stream_include_usage.txt")
        .read_bytes()
        .split(b"\n\n")[:-1]
    ]
    token_event = events[2]
    print(f"token event: {len(token_event)} bytes")
    sniff = StreamFilter(injected_usage=False)
    _time("StreamFilter.feed, client asked usage (sniff only)", lambda: sniff.feed(token_event))
    injected = StreamFilter(injected_usage=True)
    _time("StreamFilter.feed, injected, token event", lambda: injected.feed(token_event))
    half = len(token_event) // 2
    first, second = token_event[:half], token_event[half:]

    def split() -> None:
        injected.feed(first)
        injected.feed(second)

    _time("StreamFilter.feed x2, injected, event split in two", split)

    def whole_stream() -> None:
        f = StreamFilter(injected_usage=True)
        for event in events:
            f.feed(event)
        f.close()

    _time(f"StreamFilter, injected, whole {len(events)}-event stream", whole_stream, 5_000)

    answer = (FIXTURES / "llamacpp_chat.json").read_bytes()

    def sniff_json() -> object:
        s = UsageSniffer()
        s.feed(answer)
        return s.usage

    _time(f"UsageSniffer feed+usage, {len(answer)}-byte chat answer", sniff_json)
    big = [b"0.123456789," * 5000] * 40  # a 2.4 MB embeddings answer in 60 KB chunks
    big.append(b'0.1],"usage":{"prompt_tokens":12,"total_tokens":12}}')
    big.insert(0, b'{"object":"list","data":[{"embedding":[')

    def sniff_big() -> object:
        s = UsageSniffer()
        for chunk in big:
            s.feed(chunk)
        return s.usage

    _time("UsageSniffer feed+usage, 2.4 MB answer in 42 chunks", sniff_big, 2_000)

    m = Metrics()
    _time(
        "Metrics.observe_request (200, 3 histograms)",
        lambda: m.observe_request("qwen3-8b", "mbd_ab12", 200, 0.5, ttfb=0.05, overhead=0.0008),
    )
    _time(
        "Metrics.observe_request (503 with error code)",
        lambda: m.observe_request(
            "qwen3-8b", "mbd_ab12", 503, 0.001, overhead=0.0004, error_code="model_not_ready"
        ),
    )
    _time("Metrics.add_tokens", lambda: m.add_tokens("qwen3-8b", "mbd_ab12", 700, 120))

    def flight() -> None:
        with m.in_flight("qwen3-8b"):
            pass

    _time("Metrics.in_flight (enter+exit)", flight)
    _time("Metrics.render (1 model, 1 key)", m.render, 2_000)


if __name__ == "__main__":
    main()
