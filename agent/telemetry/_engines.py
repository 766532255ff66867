"""What each running engine costs and reports: process-group CPU and RSS, and /metrics.

The telemetry sampler (``_host.Telemetry``) asks this module two things per engine
every 5 s (docs/decisions.md D61):

- :class:`GroupMeter` sums ``cpu_percent`` and RSS over the engine's whole process group
  (100 = one full core). It keeps the ``psutil.Process`` objects between samples,
  because ``cpu_percent`` measures against the previous call on the *same* object; a
  process seen for the first time counts 0 % in that sample.
- :func:`scrape` reads the engine's Prometheus ``/metrics`` with the instance's own key,
  bounded in time and size, and :func:`engine_metrics` maps the runtime's names onto
  the contract's KPI names through one table (:data:`METRIC_NAMES`) that llama.cpp and
  vLLM share. A KPI the runtime does not report stays absent, never zero.

Counters stay counters: the master turns them into rates between two samples, and it
also owns the sampling interval. That is why time to first token travels as the
histogram's ``_sum`` and ``_count`` (``timeToFirstTokenSecondsSum``,
``timeToFirstTokenCount``) rather than as a mean or a quantile computed here: the
increase of the one over the increase of the other is the mean of the requests that
got their first token in that interval, exact whatever the buckets, and two numbers
per engine fit the history where a bucket vector would not (docs/operator-guide.md
"Logs and engine telemetry").

The Prometheus text is read by a small strict parser (the agent does not depend on
prometheus_client): a line it cannot read fails the whole scrape, so a garbage body
is a ``metricsError`` rather than half-read numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil

__all__ = [
    "MAX_METRICS_BYTES",
    "METRIC_NAMES",
    "SCRAPE_TIMEOUT_SECONDS",
    "EngineTarget",
    "GroupMeter",
    "MetricsError",
    "engine_metrics",
    "parse_prometheus",
    "scrape",
]

SCRAPE_TIMEOUT_SECONDS = 2.0
MAX_METRICS_BYTES = 1024 * 1024

# Runtime metric name -> the contract's KPI. One table for every runtime: llama.cpp's
# names and vLLM's, those of its V0 engine and of V1 under its old and new names. Where
# two names feed one KPI the first one reported wins: vLLM renamed
# gpu_cache_usage_perc to kv_cache_usage_perc and printed both, with one value, for a
# few releases before dropping the old one. Both are a fraction 0..1 despite "perc",
# the unit of llama.cpp's ratio. Counters are named as printed (prometheus_client
# appends _total and adds _created samples, which no KPI reads).
METRIC_NAMES: dict[str, str] = {
    "llamacpp:requests_processing": "requestsRunning",
    "llamacpp:requests_deferred": "requestsWaiting",
    "llamacpp:prompt_tokens_total": "promptTokensTotal",
    "llamacpp:tokens_predicted_total": "generationTokensTotal",
    "llamacpp:kv_cache_usage_ratio": "kvCacheUsageRatio",
    "llamacpp:kv_cache_tokens": "kvCacheTokens",
    "vllm:num_requests_running": "requestsRunning",
    "vllm:num_requests_waiting": "requestsWaiting",
    "vllm:prompt_tokens_total": "promptTokensTotal",
    "vllm:generation_tokens_total": "generationTokensTotal",
    "vllm:kv_cache_usage_perc": "kvCacheUsageRatio",
    "vllm:gpu_cache_usage_perc": "kvCacheUsageRatio",
    "vllm:gpu_prefix_cache_hit_rate": "prefixCacheHitRate",
    "vllm:time_to_first_token_seconds_sum": "timeToFirstTokenSecondsSum",
    "vllm:time_to_first_token_seconds_count": "timeToFirstTokenCount",
}
# KPIs that are ratios: several label sets (vLLM's engine cores) are averaged, not
# added; every other KPI is a count or a counter, added over the label sets.
_RATIOS = frozenset({"kvCacheUsageRatio", "prefixCacheHitRate"})
# Where a runtime reports no hit rate, it is derived from two token counters, the
# first pair reported winning: (hits, all) for vLLM V1 under its current and its
# earlier gpu_ names; llama.cpp counts the prompt tokens it reused from the cache apart
# from the ones it processed (its prompt_tokens_total excludes the cached ones), so
# there the whole is their sum.
_PREFIX_COUNTERS = (
    ("vllm:prefix_cache_hits_total", ("vllm:prefix_cache_queries_total",)),
    ("vllm:gpu_prefix_cache_hits_total", ("vllm:gpu_prefix_cache_queries_total",)),
    (
        "llamacpp:prompt_tokens_cached_total",
        ("llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total"),
    ),
)

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
_SAMPLE_RE = re.compile(
    rf"(?P<name>{_NAME})"
    rf"(?:\{{\s*(?:{_LABEL}(?:\s*,\s*{_LABEL})*\s*,?\s*)?\}})?"
    r"[ \t]+(?P<value>\S+)"
    r"(?:[ \t]+-?[0-9]+)?"
)


class MetricsError(Exception):
    """The engine's /metrics could not be read; the message says why (never the key)."""


@dataclass(frozen=True)
class EngineTarget:
    """One running engine as the sampler sees it (the runtime fills these in)."""

    instance_id: str
    state: str
    pid: int
    port: int | None
    key: str
    ready: bool


def _value(text: str) -> float:
    # Prometheus spells the specials its own way; float() reads "NaN", "+Inf", "-Inf".
    return float(text)


def parse_prometheus(text: str) -> dict[str, list[float]]:
    """Every sample's values by metric name (label sets are kept as separate values).

    Strict: comments and blank lines are skipped; any other line that is not
    ``name{labels} value [timestamp]`` raises :class:`MetricsError` naming its line.
    """
    samples: dict[str, list[float]] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.fullmatch(line)
        if match is None:
            raise MetricsError(f"line {number} of /metrics is not Prometheus text: {line[:80]!r}")
        try:
            value = _value(match["value"])
        except ValueError:
            raise MetricsError(
                f"line {number} of /metrics has no number: {match['value'][:40]!r}"
            ) from None
        samples.setdefault(match["name"], []).append(value)
    return samples


def engine_metrics(samples: dict[str, list[float]]) -> dict[str, float]:
    """The contract's KPIs found in ``samples``; one a runtime does not report is absent.

    Several label sets of one metric are added (counts) or averaged (ratios); a NaN or
    infinite value counts as not reported (JSON has no such numbers), and so does a sum
    too large for a float.
    """
    out: dict[str, float] = {}
    for name, kpi in METRIC_NAMES.items():
        if kpi in out:
            continue
        found = _finite_sum(samples, name)
        if found is None:
            continue
        total, count = found
        out[kpi] = total / count if kpi in _RATIOS else total
    for hits_name, whole_names in _PREFIX_COUNTERS:
        if "prefixCacheHitRate" in out:
            break
        hits = _finite_sum(samples, hits_name)
        parts = [_finite_sum(samples, name) for name in whole_names]
        if hits is None or any(part is None for part in parts):
            continue
        whole = _fsum(part[0] for part in parts if part is not None)
        # No prompt yet: no rate, rather than a made-up 0.
        if whole is not None and whole > 0 and math.isfinite(hits[0] / whole):
            out["prefixCacheHitRate"] = hits[0] / whole
    return out


def _fsum(values: Iterable[float]) -> float | None:
    """The exact sum, or None where it leaves the floats (an engine's garbage, never a
    crash of the sampler)."""
    try:
        total = math.fsum(values)
    except OverflowError:
        return None
    return total if math.isfinite(total) else None


def _finite_sum(samples: dict[str, list[float]], name: str) -> tuple[float, int] | None:
    """The sum of ``name``'s finite values over its label sets, and how many there were."""
    values = [v for v in samples.get(name, ()) if math.isfinite(v)]
    total = _fsum(values) if values else None
    return None if total is None else (total, len(values))


async def scrape(
    session: aiohttp.ClientSession,
    port: int,
    key: str,
    *,
    time_limit: float = SCRAPE_TIMEOUT_SECONDS,
    max_bytes: int = MAX_METRICS_BYTES,
) -> dict[str, float]:
    """The KPIs of the engine on ``127.0.0.1:port``; :class:`MetricsError` says why not."""
    url = f"http://127.0.0.1:{port}/metrics"
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with asyncio.timeout(time_limit):
            async with session.get(url, headers=headers, allow_redirects=False) as response:
                if response.status != 200:
                    detail = (await response.content.read(200)).decode("utf-8", "replace")
                    raise MetricsError(
                        f"/metrics answered {response.status}: {detail.strip()[:200]}"
                    )
                if (response.content_length or 0) > max_bytes:
                    raise MetricsError(f"/metrics is larger than {max_bytes} bytes")
                body = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) > max_bytes:
                        raise MetricsError(f"/metrics is larger than {max_bytes} bytes")
    except TimeoutError:
        raise MetricsError(f"/metrics did not answer within {time_limit:g} s") from None
    except aiohttp.ClientError as exc:
        raise MetricsError(f"/metrics could not be read: {type(exc).__name__}: {exc}") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsError("/metrics is not UTF-8 text") from None
    return engine_metrics(parse_prometheus(text))


def _group_members(leaders: list[int]) -> dict[int, set[int]]:
    """The pids of each leader's process group and process tree (see ``group_rss``)."""
    members: dict[int, set[int]] = {leader: set() for leader in leaders}
    for leader, found in members.items():
        with contextlib.suppress(psutil.Error):
            found.add(leader)
            found.update(c.pid for c in psutil.Process(leader).children(recursive=True))
    # One scan of all processes for every group: a helper that outlived its parent is
    # no longer in the tree but still in the group.
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            pgid = os.getpgid(pid)
            if pgid in members:
                members[pgid].add(pid)
    return members


class GroupMeter:
    """CPU percent and RSS summed over engine process groups, sample after sample.

    Not thread-safe: the sampler calls :meth:`measure` from one thread at a time.
    """

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def _process(self, pid: int) -> tuple[psutil.Process, bool]:
        """The kept object for ``pid`` and whether it is new (no baseline yet)."""
        known = self._procs.get(pid)
        # is_running() compares the creation time: a reused pid is a new process.
        if known is not None and known.is_running():
            return known, False
        proc = psutil.Process(pid)
        self._procs[pid] = proc
        return proc, True

    def measure(self, leaders: list[int]) -> dict[int, dict[str, Any]]:
        """``{leader: {"cpuPercent": float, "rssBytes": int}}`` (blocking; run in a thread)."""
        out: dict[int, dict[str, Any]] = {}
        seen: set[int] = set()
        for leader, pids in _group_members(leaders).items():
            cpu, rss = 0.0, 0
            for pid in sorted(pids):
                try:
                    proc, new = self._process(pid)
                    with proc.oneshot():
                        # A new object's first call only sets the baseline (it answers 0).
                        percent = proc.cpu_percent(interval=None)
                        cpu += 0.0 if new else percent
                        rss += proc.memory_info().rss
                except psutil.Error:  # gone meanwhile, a zombie, or not ours to read
                    continue
                seen.add(pid)
            out[leader] = {"cpuPercent": round(cpu, 1), "rssBytes": rss}
        for pid in set(self._procs) - seen:
            del self._procs[pid]
        return out
