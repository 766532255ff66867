"""Telemetry samples as the agent sends them, and a clean history in Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from nodes import stalls, status_cache, telemetry

GIB = 2**30
DISK = {"path": "/var/lib/mirbad", "totalBytes": 100 * GIB, "freeBytes": 40 * GIB, "percent": 60.0}
GPU = {
    "index": 0,
    "name": "H100",
    "memoryTotalBytes": 80 * GIB,
    "memoryUsedBytes": 20 * GIB,
    "utilizationPercent": 55.0,
}


def engine(
    instance_id: str,
    *,
    running: float | None = 1,
    waiting: float | None = 0,
    prompt: float | None = 0,
    gen: float | None = 0,
    kv: float | None = 0.25,
    kv_tokens: float | None = None,
    prefix_hit: float | None = 0.5,
    rss: int | None = 3 * GIB,
    cpu: float | None = 120.0,
    scraped: bool = True,
) -> dict[str, Any]:
    """One ``engines`` entry; a None drops that key (an engine that does not report it)."""
    raw: dict[str, Any] = {"instanceId": instance_id, "pid": 4242}
    if cpu is not None:
        raw["cpuPercent"] = cpu
    if rss is not None:
        raw["rssBytes"] = rss
    if not scraped:
        raw["metricsError"] = "connection refused"
        return raw
    values = {
        "requestsRunning": running,
        "requestsWaiting": waiting,
        "promptTokensTotal": prompt,
        "generationTokensTotal": gen,
        "kvCacheUsageRatio": kv,
        "kvCacheTokens": kv_tokens,
        "prefixCacheHitRate": prefix_hit,
    }
    raw["metrics"] = {k: v for k, v in values.items() if v is not None}
    return raw


def sample(
    *engines: dict[str, Any],
    cpu: float = 12.5,
    used: int = 6 * GIB,
    total: int = 16 * GIB,
    gpus: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A full ``/agent/v1/telemetry`` sample (fresh lists: tests may change them)."""
    return {
        "time": "2025-01-01T00:00:00Z",
        "cpuPercent": cpu,
        "cpuPerCore": [cpu, cpu],
        "cpuCount": 2,
        "load": [0.5, 0.4, 0.3],
        "memory": {
            "totalBytes": total,
            "availableBytes": total - used,
            "usedBytes": used,
            "percent": 100 * used / total,
        },
        "disks": [dict(DISK)],
        "gpus": gpus if gpus is not None else [dict(GPU)],
        "engines": list(engines),
    }


@pytest.fixture
def history() -> Iterator[None]:
    """The telemetry history in the test Redis, emptied before and after the test."""

    def clear() -> None:
        client = status_cache.sync_client()
        prefixes = (telemetry.FINE_PREFIX, telemetry.COARSE_PREFIX, telemetry.SUMS_PREFIX)
        for prefix in (*prefixes, stalls.FLAGS_PREFIX):
            for key in client.scan_iter(f"{prefix}*"):
                client.delete(key)

    clear()
    yield
    clear()
