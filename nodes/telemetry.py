"""Each node's telemetry history in Redis: one hour at 5 s, 24 hours at one minute.

The monitor receives every node's telemetry sample every 5 s
(``nodes.monitor_worker.NodeWorker``: in each heartbeat, or pulled from an older agent's
``/agent/v1/telemetry``) and hands it to :func:`arecord`, which turns it into a
:class:`Point` and keeps two bounded lists per node (docs/decisions.md D63) and one
small record:

- ``mirbad:telemetry:fine:<node>``: the last :data:`FINE_POINTS` points (one hour
  at 5 s), as sampled;
- ``mirbad:telemetry:coarse:<node>``: the last :data:`COARSE_POINTS` points (24
  hours at one minute), each the :func:`downsample` of one minute's fine points.
  The current minute's coarse point is rewritten with every fine point, so the
  24 h chart reaches up to the last sample;
- ``mirbad:telemetry:sums:<node>``: the newest point's engine values summed over its
  engines (:func:`encode_sums`), for the Overview's fleet-wide tiles
  (:func:`engine_sums`); it expires soon after its point stops being current.

Both lists expire when no sample came for as long as they cover, so a removed
node's history vanishes by itself. Points are stored as compact positional JSON
(bytes in MiB, values rounded to what a chart or a rule tells apart): a node
with one GPU and one engine holds 255 KiB, one with two GPUs and three engines
533 KiB (tests/nodes/test_telemetry_history.py measures it).

Every key the agent may leave out (older agents, a failed engine scrape) is
``None`` in the point: unknown, never zero. A point's ``t`` is the master's
clock when the sample arrived, not the agent's (an agent's clock may be off;
that is a reason of its own, ``clock_skew``). :func:`latest` refuses a point
older than :data:`CURRENT_SECONDS`: a sample more than a minute old is never
shown as current.

Reads (:func:`series`, :func:`latest`, :func:`latest_many`, :func:`recent_many`,
:func:`engine_sums`) are synchronous, for views and the /metrics collector's thread, and
use the status cache's reading client (short timeout, no retry): a Redis that is down
answers "no history", never an error page.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypedDict, cast

import orjson
import redis
import redis.asyncio as aioredis

from nodes import status_cache
from protocol.names import INSTANCE_ID_RE

log = logging.getLogger("mirbad.telemetry")

FINE_PREFIX = "mirbad:telemetry:fine:"
COARSE_PREFIX = "mirbad:telemetry:coarse:"
SUMS_PREFIX = "mirbad:telemetry:sums:"
INTERVAL_SECONDS = 5.0  # the monitor's sampling step (the agent's heartbeat)
FINE_POINTS = 720  # one hour at 5 s
COARSE_STEP_SECONDS = 60.0
COARSE_POINTS = 1440  # 24 hours at one minute
FINE_TTL_SECONDS = 3600 + 60  # a list nobody wrote to for its whole span holds nothing current
COARSE_TTL_SECONDS = 86400 + 60
CURRENT_SECONDS = 60.0  # older than this, a point is history, never "current"
# A node's engine sums outlive its newest point's minute as current, then go.
SUMS_TTL_SECONDS = int(CURRENT_SECONDS) + 10
RATE_MAX_GAP_SECONDS = 30.0  # a longer gap between two samples gives no rate
# Fine points read back to rebuild the current minute's coarse point: 12 at 5 s,
# with room for the extra samples a reconnect adds.
_MINUTE_READBACK = 24
# Bounds against an agent that reports too much: each engine costs ~65 bytes a point
# (140 KiB of history), each GPU ~25 (55 KiB); at these limits a node holds ~3 MiB.
MAX_ENGINES = 16
MAX_GPUS = 16
_FORMAT = 1  # the first element of every stored point
_BYTES_UNIT = 2**20  # bytes are stored in MiB

WINDOWS: dict[str, float] = {"1h": 3600.0, "24h": 86400.0}
Window = Literal["1h", "24h"]


class GpuPoint(TypedDict):
    index: int
    memUsed: int | None
    memTotal: int | None
    util: float | None


class EnginePoint(TypedDict):
    """One engine in a point. ``promptTotal``/``genTotal`` are the engine's counters,
    kept so the next point's rates can be computed from them."""

    cpu: float | None  # percent, 100 = one core
    rss: int | None
    running: float | None
    waiting: float | None
    promptTps: float | None
    genTps: float | None
    kv: float | None  # KV-cache usage, 0..1
    kvTokens: float | None
    prefixHit: float | None  # 0..1
    promptTotal: float | None
    genTotal: float | None
    # Mean time to first token over the interval (seconds), from the engine's histogram
    # sum and count (vLLM); last in the tuple, so points stored before it decode as None.
    ttft: float | None
    ttftSum: float | None
    ttftCount: float | None


class Point(TypedDict):
    t: float  # epoch seconds, the master's clock
    cpu: float | None
    memUsed: int | None
    memTotal: int | None
    load1: float | None
    gpus: list[GpuPoint]
    engines: dict[str, EnginePoint]  # by instance id


_ENGINE_FIELDS: tuple[str, ...] = tuple(EnginePoint.__annotations__)
_INT_ENGINE_FIELDS = frozenset({"rss"})
_TOTALS = frozenset({"promptTotal", "genTotal", "ttftSum", "ttftCount"})
# The engine fields a node's sums record holds (engine_sums): the values, not the bytes
# (rss) nor the counters.
SUMMED_FIELDS: tuple[str, ...] = tuple(
    f for f in _ENGINE_FIELDS if f not in _INT_ENGINE_FIELDS and f not in _TOTALS
)
# Decimals kept per stored field: what a chart or a rule can tell apart, no more.
_ROUND = {
    "cpu": 1,
    "engineCpu": 0,  # 100 = one core
    "load1": 2,
    "util": 0,
    "running": 2,
    "waiting": 2,
    "kv": 4,
    "kvTokens": 0,
    "prefixHit": 3,
    "ttft": 4,
}
# Rates keep three significant digits: a token in 30 s is 0.0333/s, never rounded to 0.
_SIGNIFICANT = frozenset({"promptTps", "genTps"})


# -- building points (pure) ---------------------------------------------------------------


def _float(value: object) -> float | None:
    """A finite number, else None (absent, a string, NaN: unknown, never zero)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _bytes(value: object) -> int | None:
    number = _float(value)
    return int(number) if number is not None and number >= 0 else None


def _rate(current: float | None, before: float | None, seconds: float | None) -> float | None:
    """Counter increase per second; None without both counters, after an engine
    restart (the counter went backwards) or across a gap."""
    if current is None or before is None or seconds is None or current < before:
        return None
    return (current - before) / seconds


def _engine(
    raw: dict[str, Any], previous: EnginePoint | None, seconds: float | None
) -> EnginePoint:
    metrics = raw.get("metrics")
    metrics = metrics if isinstance(metrics, dict) else {}  # absent: the scrape failed
    prompt_total = _float(metrics.get("promptTokensTotal"))
    gen_total = _float(metrics.get("generationTokensTotal"))
    ttft_sum = _float(metrics.get("timeToFirstTokenSecondsSum"))
    ttft_count = _float(metrics.get("timeToFirstTokenCount"))
    return EnginePoint(
        cpu=_float(raw.get("cpuPercent")),
        rss=_bytes(raw.get("rssBytes")),
        running=_float(metrics.get("requestsRunning")),
        waiting=_float(metrics.get("requestsWaiting")),
        promptTps=_rate(prompt_total, previous["promptTotal"] if previous else None, seconds),
        genTps=_rate(gen_total, previous["genTotal"] if previous else None, seconds),
        kv=_float(metrics.get("kvCacheUsageRatio")),
        kvTokens=_float(metrics.get("kvCacheTokens")),
        prefixHit=_float(metrics.get("prefixCacheHitRate")),
        promptTotal=prompt_total,
        genTotal=gen_total,
        ttft=_interval_mean(
            ttft_sum,
            ttft_count,
            (previous.get("ttftSum"), previous.get("ttftCount")) if previous else None,
            seconds,
        ),
        ttftSum=ttft_sum,
        ttftCount=ttft_count,
    )


def _interval_mean(
    total: float | None,
    count: float | None,
    before: tuple[float | None, float | None] | None,
    seconds: float | None,
) -> float | None:
    """The mean of what a histogram observed since the last point: the increase of its
    sum over the increase of its count; None when nothing was observed, after a reset
    (either went backwards) or across a gap."""
    if total is None or count is None or before is None or seconds is None:
        return None
    total_before, count_before = before
    if total_before is None or count_before is None:
        return None
    observed = count - count_before
    if observed <= 0 or total < total_before:
        return None
    return (total - total_before) / observed


def _gpus(raw: object) -> list[GpuPoint]:
    out: dict[int, GpuPoint] = {}
    for gpu in raw if isinstance(raw, list) else []:
        if not isinstance(gpu, dict):
            continue
        index = gpu.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 256:
            continue
        if len(out) >= MAX_GPUS:
            break
        out[index] = GpuPoint(
            index=index,
            memUsed=_bytes(gpu.get("memoryUsedBytes")),
            memTotal=_bytes(gpu.get("memoryTotalBytes")),
            util=_float(gpu.get("utilizationPercent")),
        )
    return [out[i] for i in sorted(out)]


def point_from_sample(sample: object, previous: Point | None, now: float) -> Point:
    """The point of one ``/telemetry`` sample, taken at ``now`` (the master's clock).

    ``previous`` is the node's last fine point: each engine's rates are its counters'
    increase since then, or None for the first point, a counter that went backwards
    (the engine restarted) or a gap over :data:`RATE_MAX_GAP_SECONDS`. Only engines
    with a valid instance id are kept, at most :data:`MAX_ENGINES`.
    """
    data = sample if isinstance(sample, dict) else {}
    memory = data.get("memory")
    memory = memory if isinstance(memory, dict) else {}
    load = data.get("load")
    seconds: float | None = None
    if previous is not None and 0 < now - previous["t"] <= RATE_MAX_GAP_SECONDS:
        seconds = now - previous["t"]
    before = previous["engines"] if previous is not None else {}
    engines: dict[str, EnginePoint] = {}
    raw_engines = data.get("engines")
    for raw in raw_engines if isinstance(raw_engines, list) else []:
        if not isinstance(raw, dict):
            continue
        instance_id = raw.get("instanceId")
        if not isinstance(instance_id, str) or not INSTANCE_ID_RE.fullmatch(instance_id):
            continue
        if len(engines) >= MAX_ENGINES:
            break
        engines[instance_id] = _engine(raw, before.get(instance_id), seconds)
    return Point(
        t=now,
        cpu=_float(data.get("cpuPercent")),
        memUsed=_bytes(memory.get("usedBytes")),
        memTotal=_bytes(memory.get("totalBytes")),
        load1=_float(load[0]) if isinstance(load, list) and load else None,
        gpus=_gpus(data.get("gpus")),
        engines=engines,
    )


def _mean(values: Iterable[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _mean_int(values: Iterable[int | None]) -> int | None:
    mean = _mean(values)
    return round(mean) if mean is not None else None


def _last(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return known[-1] if known else None


def downsample(points: Sequence[Point]) -> Point:
    """One point for ``points`` (one minute's fine points, oldest first).

    ``t`` is the start of the first point's minute. Each value is the mean of the
    points that have it, ignoring Nones; a value no point has stays None, so a chart
    shows a gap. The counters (``promptTotal``/``genTotal``) are the last known.
    """
    if not points:
        raise ValueError("downsample needs at least one point")
    gpus: dict[int, list[GpuPoint]] = {}
    engines: dict[str, list[EnginePoint]] = {}
    for point in points:
        for gpu in point["gpus"]:
            gpus.setdefault(gpu["index"], []).append(gpu)
        for instance_id, engine in point["engines"].items():
            engines.setdefault(instance_id, []).append(engine)
    merged_engines: dict[str, EnginePoint] = {}
    for instance_id, seen in list(engines.items())[:MAX_ENGINES]:
        values: dict[str, Any] = {}
        for field in _ENGINE_FIELDS:
            column = [e[field] for e in seen]  # type: ignore[literal-required]  # fields of EnginePoint
            if field in _TOTALS:
                values[field] = _last(column)
            elif field in _INT_ENGINE_FIELDS:
                values[field] = _mean_int(column)
            else:
                values[field] = _mean(column)
        merged_engines[instance_id] = cast(EnginePoint, values)  # every field set above
    return Point(
        t=math.floor(points[0]["t"] / COARSE_STEP_SECONDS) * COARSE_STEP_SECONDS,
        cpu=_mean(p["cpu"] for p in points),
        memUsed=_mean_int(p["memUsed"] for p in points),
        memTotal=_mean_int(p["memTotal"] for p in points),
        load1=_mean(p["load1"] for p in points),
        gpus=[
            GpuPoint(
                index=index,
                memUsed=_mean_int(g["memUsed"] for g in seen_gpus),
                memTotal=_mean_int(g["memTotal"] for g in seen_gpus),
                util=_mean(g["util"] for g in seen_gpus),
            )
            for index, seen_gpus in sorted(gpus.items())[:MAX_GPUS]
        ],
        engines=merged_engines,
    )


def empty_point(t: float) -> Point:
    """A point with no values: where a series has a hole, so a chart breaks its line."""
    return Point(t=t, cpu=None, memUsed=None, memTotal=None, load1=None, gpus=[], engines={})


# -- the stored form ----------------------------------------------------------------------


def _r(value: float | None, field: str) -> float | int | None:
    if value is None:
        return None
    if field in _SIGNIFICANT and value != 0:
        # Three significant digits (195, 62.2, 0.0333): a rate's noise is larger.
        value = round(value, max(0, 2 - math.floor(math.log10(abs(value)))))
    rounded = round(value, _ROUND[field]) if field in _ROUND else value
    # 12.0 is stored as 12: two bytes fewer, the same number back.
    return int(rounded) if float(rounded).is_integer() and abs(rounded) < 2**53 else rounded


def _kib(value: int | None) -> int | None:
    """Bytes are stored in MiB: six digits fewer each, nothing a chart or a budget can
    tell apart (GPU memory is reported in MiB anyway)."""
    return None if value is None else round(value / _BYTES_UNIT)


def _trimmed(values: list[Any]) -> list[Any]:
    while values and values[-1] is None:
        values.pop()
    return values


def encode(point: Point, *, counters: bool = True) -> str:
    """Compact positional JSON: ``[format, t, cpu, memUsed, memTotal, load1, gpus, engines]``.

    Bytes in MiB, values rounded to what a chart or a rule tells apart, an engine's
    trailing Nones left out. ``counters=False`` leaves out the engines' counters (the
    coarse list needs no rates computed from it).
    """
    gpus = [
        _trimmed([g["index"], _kib(g["memUsed"]), _kib(g["memTotal"]), _r(g["util"], "util")])
        for g in point["gpus"]
    ]
    engines: dict[str, list[Any]] = {}
    for instance_id, e in point["engines"].items():
        values: list[Any] = []
        for field in _ENGINE_FIELDS:
            value = e[field]  # type: ignore[literal-required]  # fields of EnginePoint
            if field in _INT_ENGINE_FIELDS:
                values.append(_kib(value))
            elif field in _TOTALS and not counters:
                values.append(None)
            else:
                values.append(_r(value, "engineCpu" if field == "cpu" else field))
        engines[instance_id] = _trimmed(values)
    t = round(point["t"], 2)
    row = [
        _FORMAT,
        int(t) if t.is_integer() else t,
        _r(point["cpu"], "cpu"),
        _kib(point["memUsed"]),
        _kib(point["memTotal"]),
        _r(point["load1"], "load1"),
        gpus,
        engines,
    ]
    return json.dumps(row, separators=(",", ":"))


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _bytes_of(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value * _BYTES_UNIT


def _padded(values: list[Any], length: int) -> list[Any]:
    if not isinstance(values, list) or len(values) > length:
        raise ValueError("not a stored row")
    return values + [None] * (length - len(values))


def decode(raw: str | bytes | None) -> Point | None:
    """The point of :func:`encode`, or None for anything else (an unknown format)."""
    if raw is None:
        return None
    try:
        row = json.loads(raw)
        if not isinstance(row, list) or len(row) != 8 or row[0] != _FORMAT:
            return None
        t = _num(row[1])
        if t is None:
            return None
        engines: dict[str, EnginePoint] = {}
        for instance_id, stored in row[7].items():
            fields: dict[str, Any] = {}
            values = _padded(stored, len(_ENGINE_FIELDS))
            for field, value in zip(_ENGINE_FIELDS, values, strict=True):
                fields[field] = _bytes_of(value) if field in _INT_ENGINE_FIELDS else _num(value)
            engines[instance_id] = cast(EnginePoint, fields)  # every field set above
        gpus: list[GpuPoint] = []
        for stored in row[6]:
            g = _padded(stored, 4)
            gpus.append(
                GpuPoint(
                    index=int(g[0]), memUsed=_bytes_of(g[1]), memTotal=_bytes_of(g[2]),
                    util=_num(g[3]),
                )
            )  # fmt: skip
        return Point(
            t=t,
            cpu=_num(row[2]),
            memUsed=_bytes_of(row[3]),
            memTotal=_bytes_of(row[4]),
            load1=_num(row[5]),
            gpus=gpus,
            engines=engines,
        )
    except (ValueError, TypeError, AttributeError, IndexError):
        return None


def _decode_all(raws: Iterable[str | bytes | None]) -> list[Point]:
    points = [p for p in (decode(r) for r in raws) if p is not None]
    points.sort(key=lambda p: p["t"])  # a clock step back may have stored one out of order
    return points


def fine_key(node_id: str) -> str:
    return f"{FINE_PREFIX}{node_id}"


def coarse_key(node_id: str) -> str:
    return f"{COARSE_PREFIX}{node_id}"


def sums_key(node_id: str) -> str:
    return f"{SUMS_PREFIX}{node_id}"


def _minute(t: float) -> float:
    return math.floor(t / COARSE_STEP_SECONDS) * COARSE_STEP_SECONDS


def encode_sums(point: Point) -> bytes:
    """``[t, sum, ...]``: each of :data:`SUMMED_FIELDS` summed over the point's engines in
    their order (None when no engine has it), from the point as stored (rounded), so the
    sums equal those of the decoded point."""
    sums: list[float | None] = []
    for field in SUMMED_FIELDS:
        total: float | None = None
        for engine in point["engines"].values():
            value = engine[field]  # type: ignore[literal-required]  # fields of EnginePoint
            if value is not None:
                total = (total or 0.0) + value
        sums.append(total)
    return orjson.dumps([point["t"], *sums])


# -- writing (the monitor) ----------------------------------------------------------------


class Recent:
    """A node's newest fine points, decoded, as its monitor worker keeps them.

    Read back from Redis once (the worker's first sample) and then kept in step with
    what :func:`arecord` writes: reading and decoding the last points again at every
    sample (24 for the rates and the minute, 72 more for the stall rules) was the
    monitor's largest cost per node at 1,000 nodes (docs/performance.md, "A fleet of a
    thousand machines").
    """

    def __init__(self, size: int) -> None:
        self.size = max(size, _MINUTE_READBACK)
        self.points: collections.deque[Point] = collections.deque(maxlen=self.size)
        self.coarse_t: float | None = None  # the newest coarse point's minute
        self.loaded = False


async def aload(node_id: str, recent: Recent) -> None:
    """Read the node's last fine points and last coarse point into ``recent`` (once)."""
    if recent.loaded:
        return
    async with status_cache.async_client().pipeline(transaction=False) as pipe:
        pipe.lrange(fine_key(node_id), -recent.size, -1)
        pipe.lindex(coarse_key(node_id), -1)
        recent_raw, last_coarse_raw = await pipe.execute()
    last_coarse = decode(last_coarse_raw)
    recent.points.clear()
    recent.points.extend(p for p in (decode(r) for r in recent_raw) if p is not None)
    recent.coarse_t = None if last_coarse is None else last_coarse["t"]
    recent.loaded = True


def stage(
    node_id: str, sample: object, now: float, recent: Recent, pipe: aioredis.client.Pipeline
) -> Point:
    """Queue one sample's writes on ``pipe`` (a transaction) and return its point:
    append it, rewrite the current minute, trim and renew the expiries. ``recent`` (loaded)
    takes the point as stored at once; a transaction that then fails leaves it one point
    ahead of Redis, which only the rates of the next sample read."""
    fine, coarse = fine_key(node_id), coarse_key(node_id)
    previous = recent.points[-1] if recent.points else None
    point = point_from_sample(sample, previous, now)
    minute = _minute(now)
    this_minute = [p for p in recent.points if _minute(p["t"]) == minute and p["t"] <= now]
    summary = downsample([*this_minute, point])
    encoded = encode(point)
    pipe.rpush(fine, encoded)
    pipe.ltrim(fine, -FINE_POINTS, -1)
    pipe.expire(fine, FINE_TTL_SECONDS)
    if recent.coarse_t == minute:
        pipe.lset(coarse, -1, encode(summary, counters=False))
    else:
        pipe.rpush(coarse, encode(summary, counters=False))
        pipe.ltrim(coarse, -COARSE_POINTS, -1)
    pipe.expire(coarse, COARSE_TTL_SECONDS)
    # Kept as stored: the points read back are rounded by encode(), and the rules read
    # the same values whether a worker is new or not.
    stored = decode(encoded)
    # The Overview's tiles sum engine values over the fleet's newest points: this small
    # record saves it reading and decoding a thousand of them (engine_sums).
    pipe.set(sums_key(node_id), encode_sums(stored or point), ex=SUMS_TTL_SECONDS)
    recent.points.append(stored if stored is not None else point)
    recent.coarse_t = minute
    return point


async def arecord(
    node_id: str, sample: object, now: float | None = None, *, recent: Recent | None = None
) -> Point:
    """Add one sample to the node's history and return its point.

    Without ``recent`` (or before it is loaded) one round trip reads the last fine points
    (the previous one for the rates, this minute's for the coarse point) and the last
    coarse point; with it, nothing is read. One transaction writes (:func:`stage`).
    """
    now = time.time() if now is None else now
    recent = recent if recent is not None else Recent(_MINUTE_READBACK)
    await aload(node_id, recent)
    async with status_cache.async_client().pipeline(transaction=True) as pipe:
        point = stage(node_id, sample, now, recent, pipe)
        await pipe.execute()
    return point


# -- reading (views, the Models list, /metrics) --------------------------------------------

_UNREACHABLE = (redis.RedisError, OSError)
_last_warning = 0.0


def _unreachable(exc: BaseException) -> None:
    """Log a failed read at most once a minute (a page of 100 nodes reads often)."""
    global _last_warning
    if time.monotonic() - _last_warning >= 60.0:
        _last_warning = time.monotonic()
        log.warning("Telemetry history unreadable (%s: %s)", type(exc).__name__, exc)


def _with_gaps(points: list[Point], step: float, hole: float) -> list[Point]:
    """Insert an :func:`empty_point` after each point followed by one over ``hole`` s later."""
    out: list[Point] = []
    for point in points:
        if out and point["t"] - out[-1]["t"] > hole:
            out.append(empty_point(out[-1]["t"] + step))
        out.append(point)
    return out


def series(node_id: str, window: Window, now: float | None = None) -> list[Point]:
    """The node's points of the last hour (5 s) or 24 hours (one minute), oldest first.

    Where samples are missing (the node was away) one empty point marks the hole,
    so a chart breaks its line instead of drawing across it. ``[]`` when Redis does
    not answer. A window other than ``"1h"``/``"24h"`` is a ValueError.
    """
    return series_many([node_id], window, now)[node_id]


def series_many(
    node_ids: Sequence[str], window: Window, now: float | None = None
) -> dict[str, list[Point]]:
    """:func:`series` of several nodes in one pipeline."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {', '.join(WINDOWS)}, not {window!r}")
    if not node_ids:
        return {}
    now = time.time() if now is None else now
    since = now - WINDOWS[window]
    if window == "1h":  # a hole: a gap that gives no rate, or one missing minute
        key, step, hole = fine_key, INTERVAL_SECONDS, RATE_MAX_GAP_SECONDS
    else:
        key, step, hole = coarse_key, COARSE_STEP_SECONDS, 1.5 * COARSE_STEP_SECONDS
    if status_cache.reads_paused():  # Redis failed a moment ago: no second timeout
        return {node_id: [] for node_id in node_ids}
    try:
        with status_cache.read_client().pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.lrange(key(node_id), 0, -1)
            answers = pipe.execute()
    except _UNREACHABLE as exc:
        status_cache.read_failed(exc)
        _unreachable(exc)
        return {node_id: [] for node_id in node_ids}
    return {
        node_id: _with_gaps([p for p in _decode_all(raws) if p["t"] >= since], step, hole)
        for node_id, raws in zip(node_ids, answers, strict=True)
    }


def recent_many(node_ids: Sequence[str], seconds: float) -> dict[str, list[Point]]:
    """The fine points of the last ``seconds`` of each node as stored (no gap markers),
    oldest first, in one pipeline; each list is empty when Redis does not answer."""
    if not node_ids:
        return {}
    count = math.ceil(seconds / INTERVAL_SECONDS) + 12  # room for the extra samples of reconnects
    if status_cache.reads_paused():
        return {node_id: [] for node_id in node_ids}
    try:
        with status_cache.read_client().pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.lrange(fine_key(node_id), -count, -1)
            answers = pipe.execute()
    except _UNREACHABLE as exc:
        status_cache.read_failed(exc)
        _unreachable(exc)
        return {node_id: [] for node_id in node_ids}
    return {node_id: _decode_all(raws) for node_id, raws in zip(node_ids, answers, strict=True)}


def is_current(point: Point | None, now: float | None = None) -> bool:
    """Whether ``point`` may be shown as current: at most :data:`CURRENT_SECONDS` old."""
    if point is None:
        return False
    return (time.time() if now is None else now) - point["t"] <= CURRENT_SECONDS


def latest(node_id: str, now: float | None = None) -> Point | None:
    """The node's newest point, or None when it is over a minute old (or there is none)."""
    return latest_many([node_id], now)[node_id]


def _newest_raw(node_ids: Sequence[str]) -> list[Any]:
    """Each node's newest stored point as stored (None: none, or Redis did not answer)."""
    if not node_ids or status_cache.reads_paused():
        return [None] * len(node_ids)
    try:
        with status_cache.read_client().pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.lindex(fine_key(node_id), -1)
            return list(pipe.execute())
    except _UNREACHABLE as exc:
        status_cache.read_failed(exc)
        _unreachable(exc)
        return [None] * len(node_ids)


def latest_many(node_ids: Sequence[str], now: float | None = None) -> dict[str, Point | None]:
    """:func:`latest` of each node, in one pipeline (the Nodes list renders 100)."""
    out: dict[str, Point | None] = {}
    for node_id, raw in zip(node_ids, _newest_raw(node_ids), strict=True):
        point = decode(raw)
        out[node_id] = point if is_current(point, now) else None
    return out


def engine_sums(
    node_ids: Sequence[str], fields: Sequence[str], now: float | None = None
) -> dict[str, float | None]:
    """Per engine field (``genTps``, ``waiting``..., of :data:`SUMMED_FIELDS`): its sum
    over every engine of the nodes' current points (:func:`latest_many`), None when none
    reported it.

    The same values as summing :func:`latest_many`'s points, read from the small sums
    record :func:`stage` writes beside each point (one MGET): the Overview's tiles sum two
    fields over a thousand nodes, where reading and decoding every newest point was a
    tenth of the page.
    """
    moment = time.time() if now is None else now
    if any(field not in SUMMED_FIELDS for field in fields):
        raise ValueError(f"engine_sums adds {', '.join(SUMMED_FIELDS)} only")
    columns = [(field, 1 + SUMMED_FIELDS.index(field)) for field in fields]
    sums: dict[str, float | None] = dict.fromkeys(fields)
    if not node_ids or status_cache.reads_paused():
        return sums
    try:
        raws = status_cache.read_client().mget([sums_key(n) for n in node_ids])
    except _UNREACHABLE as exc:
        status_cache.read_failed(exc)
        _unreachable(exc)
        return sums
    for raw in raws:
        if raw is None:
            continue
        try:  # a record that is not a sums record counts for nothing
            row = orjson.loads(raw)
            if not isinstance(row, list) or len(row) != len(SUMMED_FIELDS) + 1:
                continue
            t = _num(row[0])
            if t is None or moment - t > CURRENT_SECONDS:
                continue
            for field, index in columns:
                if (value := _num(row[index])) is not None:
                    sums[field] = (sums[field] or 0.0) + value
        except orjson.JSONDecodeError:
            continue
    return sums


def forget(node_id: str) -> None:
    """Delete a node's history (tests; a deleted node's lists also expire by themselves)."""
    status_cache.sync_client().delete(fine_key(node_id), coarse_key(node_id), sums_key(node_id))
