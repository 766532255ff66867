"""A vLLM engine's KPIs through the master: telemetry points and the stalled/slow rules.

The ``metrics`` objects are what the agent sends for vLLM (tests/agent/test_vllm_metrics.py
parses vLLM's own /metrics into exactly these); here they go through
``nodes.telemetry.point_from_sample`` and ``nodes.stalls`` unchanged in shape.
"""

from __future__ import annotations

from typing import Any

import pytest

from nodes import stalls, telemetry
from nodes.telemetry import Point
from tests.telemetry_support import sample

T0 = 1_700_000_040.0
STEP = telemetry.INTERVAL_SECONDS

# tests/agent/test_vllm_metrics.py ONE_ENGINE_KPIS: one engine core, 2 running, 3 waiting.
VLLM_KPIS = {
    "requestsRunning": 2.0,
    "requestsWaiting": 3.0,
    "promptTokensTotal": 15231.0,
    "generationTokensTotal": 48210.0,
    "kvCacheUsageRatio": 0.42,
    "prefixCacheHitRate": 0.25,
    "timeToFirstTokenSecondsSum": 6.371,
    "timeToFirstTokenCount": 10.0,
}


def vllm_engine(instance_id: str, **kpis: float) -> dict[str, Any]:
    return {
        "instanceId": instance_id,
        "pid": 4242,
        "cpuPercent": 130.0,
        "rssBytes": 2**30,
        "metrics": {**VLLM_KPIS, **kpis},
    }


def test_vllm_kpis_become_a_point_with_rates_from_the_counters() -> None:
    first = telemetry.point_from_sample(sample(vllm_engine("q-1")), None, T0)
    e = first["engines"]["q-1"]
    assert (e["running"], e["waiting"], e["kv"], e["prefixHit"]) == (2.0, 3.0, 0.42, 0.25)
    assert (e["promptTotal"], e["genTotal"]) == (15231.0, 48210.0)
    assert e["promptTps"] is None and e["genTps"] is None  # no previous point yet
    assert e["kvTokens"] is None  # vLLM reports a fraction only
    later = sample(
        vllm_engine("q-1", promptTokensTotal=15231.0 + 2048, generationTokensTotal=48710.0)
    )
    second = telemetry.point_from_sample(later, first, T0 + STEP)["engines"]["q-1"]
    assert second["promptTps"] == 2048 / STEP and second["genTps"] == 500 / STEP
    # Stored and read back as the charts read it (the time-to-first-token counters are
    # not part of a point: the agent reports them, the history does not keep them yet).
    stored = telemetry.decode(
        telemetry.encode(telemetry.point_from_sample(later, first, T0 + STEP))
    )
    assert stored is not None
    kept = stored["engines"]["q-1"]
    assert (kept["running"], kept["waiting"], kept["kv"], kept["prefixHit"]) == (2, 3, 0.42, 0.25)


def _points(kv: list[float]) -> list[Point]:
    """Five minutes and more of a vLLM engine with 1 request running and no token counted."""
    out: list[Point] = []
    previous: Point | None = None
    for i, ratio in enumerate(kv):
        raw = sample(
            vllm_engine(
                "q-1",
                requestsRunning=1.0,
                requestsWaiting=0.0,
                promptTokensTotal=15231.0,
                generationTokensTotal=48210.0,
                kvCacheUsageRatio=ratio,
            )
        )
        previous = telemetry.point_from_sample(raw, previous, T0 + i * STEP)
        out.append(previous)
    return out


def test_a_long_vllm_prefill_is_progress_and_a_frozen_one_is_stalled() -> None:
    count = int(stalls.WINDOW_SECONDS / STEP) + 2
    now = T0 + (count - 1) * STEP
    # Chunked prefill: vLLM counts the prompt's tokens only once it completes, but each
    # chunk fills more of the KV cache.
    growing = _points([0.10 + 0.004 * i for i in range(count)])
    found = stalls.flags(stalls.instance_points(growing, "q-1"), now)
    assert not found["stalled"] and found["slow"]
    frozen = _points([0.42] * count)
    found = stalls.flags(stalls.instance_points(frozen, "q-1"), now)
    assert found["stalled"] and not found["slow"]
    assert stalls.node_flags(frozen, now) == {"q-1": found}


def test_time_to_first_token_is_the_mean_of_what_the_interval_observed() -> None:
    from nodes.telemetry import decode, encode, point_from_sample

    def sample(total: float, count: float) -> dict:
        metrics = {"timeToFirstTokenSecondsSum": total, "timeToFirstTokenCount": count}
        return {"engines": [{"instanceId": "m1-p1", "metrics": metrics}]}

    first = point_from_sample(sample(10.0, 40), None, 1000.0)
    assert first["engines"]["m1-p1"]["ttft"] is None  # nothing to compare with yet
    second = point_from_sample(sample(13.0, 46), first, 1005.0)
    assert second["engines"]["m1-p1"]["ttft"] == pytest.approx(0.5)  # 3 s over 6 firsts
    idle = point_from_sample(sample(13.0, 46), second, 1010.0)
    assert idle["engines"]["m1-p1"]["ttft"] is None  # no first token: no figure, not 0
    restarted = point_from_sample(sample(0.2, 1), idle, 1015.0)
    assert restarted["engines"]["m1-p1"]["ttft"] is None  # the counters went backwards
    stored = decode(encode(second))
    assert stored is not None and stored["engines"]["m1-p1"]["ttft"] == pytest.approx(0.5)
