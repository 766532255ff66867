"""The stalled and slow warnings of one engine, from its node's telemetry points.

The rules (docs/operator-guide.md "Telemetry history, stalled and slow models,
/metrics"; docs/decisions.md D64):

- **Stalled**: every sample of the last 5 minutes has requests running, no prompt
  or generated tokens, and the KV-cache usage unchanged since the sample before.
  KV growth is progress: vLLM counts prompt tokens only when a prefill completes.
- **Slow**: every sample of the last 5 minutes has requests running or waiting and
  under 5 generated tokens/s.

One idle sample, one without rates (the first scrape after Ready) or less than 5
minutes of samples clears both. A replica that is stalled is not also called slow
(the fix differs). The monitor evaluates them for each node's engines at every
sample (``nodes.telemetry.arecord``) and stores the answer beside the history, so a
page of 500 models reads one small record per node instead of 5 minutes of points.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterable, Sequence
from typing import TypedDict

import redis
import redis.asyncio as aioredis

from nodes import status_cache, telemetry
from nodes.telemetry import INTERVAL_SECONDS, RATE_MAX_GAP_SECONDS, EnginePoint, Point

WINDOW_SECONDS = 300.0
# "5 minutes of samples": the oldest sample in the window is at least this old. Two
# sampling steps short of the window, so the monitor's jitter (each step is 5 s plus
# the request) does not clear a flag every other sample.
COVERAGE_SECONDS = WINDOW_SECONDS - 2 * INTERVAL_SECONDS
# No two samples further apart than this (the rate gap: a longer one has no rates
# anyway), and the newest no older than this.
MAX_GAP_SECONDS = RATE_MAX_GAP_SECONDS
SLOW_TOKENS_PER_SECOND = 5.0
_SAME = 1e-9  # the stored KV values are rounded; equal means equal

STALLED_REASON = (
    "Requests running for 5 minutes without a prompt or generated token and with the "
    "KV cache unchanged: stop and start the model; its log usually shows the last line "
    "before it froze."
)
SLOW_REASON = (
    "Requests running or waiting for 5 minutes at under 5 generated tokens/s: too much "
    "load for the model. Lower Max sequences or the context length, or find the client "
    "sending long prompts."
)


class InstancePoint(EnginePoint):
    """One replica's values at one sample; all None when the sample lacked the engine."""

    t: float


class Flags(TypedDict):
    stalled: bool
    slow: bool
    reason: str  # what to do; "" when neither


CLEAR = Flags(stalled=False, slow=False, reason="")


def empty_engine() -> EnginePoint:
    return EnginePoint(
        cpu=None,
        rss=None,
        running=None,
        waiting=None,
        promptTps=None,
        genTps=None,
        kv=None,
        kvTokens=None,
        prefixHit=None,
        promptTotal=None,
        genTotal=None,
        ttft=None,
        ttftSum=None,
        ttftCount=None,
    )


def instance_points(points: Iterable[Point], instance_id: str) -> list[InstancePoint]:
    """One replica's values out of its node's points, in their order."""
    out: list[InstancePoint] = []
    for point in points:
        engine = point["engines"].get(instance_id) or empty_engine()
        out.append(InstancePoint(t=point["t"], **engine))
    return out


# -- the rules (pure) ---------------------------------------------------------------------


def _covers(window: Sequence[InstancePoint], now: float) -> bool:
    """Whether ``window`` is 5 minutes of samples (docs/decisions.md D64)."""
    if not window or now - window[0]["t"] < COVERAGE_SECONDS:
        return False
    if now - window[-1]["t"] > MAX_GAP_SECONDS:
        return False
    return all(b["t"] - a["t"] <= MAX_GAP_SECONDS for a, b in itertools.pairwise(window))


def _kv_unchanged(before: InstancePoint, after: InstancePoint) -> bool:
    """The KV cache neither grew nor shrank; unknown is not "unchanged"."""
    if before["kvTokens"] is not None and after["kvTokens"] is not None:
        return abs(after["kvTokens"] - before["kvTokens"]) < _SAME
    if before["kv"] is not None and after["kv"] is not None:
        return abs(after["kv"] - before["kv"]) < _SAME
    return False


def _stalled_sample(p: InstancePoint) -> bool:
    return (
        (p["running"] or 0) > 0
        and p["promptTps"] is not None
        and p["genTps"] is not None
        and p["promptTps"] == 0
        and p["genTps"] == 0
    )


def _slow_sample(p: InstancePoint) -> bool:
    busy = (p["running"] or 0) > 0 or (p["waiting"] or 0) > 0
    has_rates = p["promptTps"] is not None and p["genTps"] is not None
    return busy and has_rates and p["genTps"] is not None and p["genTps"] < SLOW_TOKENS_PER_SECOND


def flags(points: Sequence[InstancePoint], now: float) -> Flags:
    """The warnings of one replica from its fine points (oldest first), as of ``now``."""
    window = [p for p in points if now - WINDOW_SECONDS <= p["t"] <= now]
    if not _covers(window, now):
        return CLEAR
    stalled = all(_stalled_sample(p) for p in window) and all(
        _kv_unchanged(a, b) for a, b in itertools.pairwise(window)
    )
    if stalled:
        return Flags(stalled=True, slow=False, reason=STALLED_REASON)
    if all(_slow_sample(p) for p in window):
        return Flags(stalled=False, slow=True, reason=SLOW_REASON)
    return CLEAR


# -- stored per node, at every sample (the monitor) ------------------------------------------

FLAGS_PREFIX = "mirbad:telemetry:flags:"
# The record holds for one rate gap: a node that stopped reporting has no flags after it.
FLAGS_TTL_SECONDS = int(RATE_MAX_GAP_SECONDS)
# The points the rules read: the monitor keeps as many (telemetry.Recent).
READBACK = math.ceil(WINDOW_SECONDS / INTERVAL_SECONDS) + 12  # room for reconnect samples


def flags_key(node_id: str) -> str:
    return f"{FLAGS_PREFIX}{node_id}"


def node_flags(points: Sequence[Point], now: float) -> dict[str, Flags]:
    """Each engine's warnings from its node's fine points (pure): only flagged engines."""
    engines = {i for p in points for i in p["engines"]}
    out: dict[str, Flags] = {}
    for instance_id in sorted(engines):
        found = flags(instance_points(points, instance_id), now)
        if found["stalled"] or found["slow"]:
            out[instance_id] = found
    return out


def stage(
    node_id: str, points: Sequence[Point], now: float, pipe: aioredis.client.Pipeline
) -> dict[str, Flags]:
    """Evaluate the node's engines over ``points`` (its newest fine points) and queue the
    record of the flagged ones on ``pipe``."""
    if points:  # stored times are rounded to 10 ms: the newest point is in its own window
        now = max(now, points[-1]["t"])
    found = node_flags(points, now)
    pipe.set(flags_key(node_id), json.dumps({"t": now, "flags": found}), ex=FLAGS_TTL_SECONDS)
    return found


async def aupdate(
    node_id: str, now: float | None = None, *, points: Sequence[Point] | None = None
) -> dict[str, Flags]:
    """Evaluate the node's engines after a sample and store the flagged ones (tests and
    tools; the monitor queues :func:`stage` in its sample's transaction). ``points``: the
    node's newest fine points; without them they are read back."""
    now = time.time() if now is None else now
    client = status_cache.async_client()
    if points is None:
        raws = await client.lrange(telemetry.fine_key(node_id), -READBACK, -1)
        points = [p for p in (telemetry.decode(r) for r in raws) if p is not None]
    async with client.pipeline(transaction=False) as pipe:
        found = stage(node_id, points, now, pipe)
        await pipe.execute()
    return found


def flags_many(node_ids: Sequence[str], now: float | None = None) -> dict[str, dict[str, Flags]]:
    """The stored flags of each node (one MGET): {} for a node without a current record,
    and for every node while Redis does not answer."""
    if not node_ids or status_cache.reads_paused():
        return {node_id: {} for node_id in node_ids}
    now = time.time() if now is None else now
    try:
        raws = status_cache.read_client().mget([flags_key(n) for n in node_ids])
    except (OSError, redis.RedisError) as exc:
        status_cache.read_failed(exc)
        return {node_id: {} for node_id in node_ids}
    out: dict[str, dict[str, Flags]] = {}
    for node_id, raw in zip(node_ids, raws, strict=True):
        record = json.loads(raw) if raw else None
        fresh = record is not None and now - float(record.get("t", 0)) <= RATE_MAX_GAP_SECONDS
        out[node_id] = dict(record["flags"]) if fresh and record else {}
    return out
