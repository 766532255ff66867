"""A model's KPIs over its replicas, from the nodes' telemetry history, and its stalled
and slow warnings: a model is flagged when one of its Ready replicas is. The rules
themselves, per engine, are nodes/stalls.py's (docs/decisions.md D64); the monitor
stores their answer per node at every sample, read here in one MGET.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from models_registry.models import ModelDefinition, Placement
from nodes import stalls, telemetry
from nodes import status as node_status
from nodes.stalls import CLEAR, Flags, empty_engine
from nodes.status_cache import NodeStatus
from nodes.telemetry import EnginePoint, Window
from protocol.states import InstanceState


class ModelPoint(TypedDict):
    """A model's values at one time, over its replicas: None when none reported it."""

    t: float
    memory: int | None  # sum of the engines' RSS
    running: float | None  # sum
    waiting: float | None  # sum
    promptTps: float | None  # sum
    genTps: float | None  # sum
    kv: float | None  # the fullest replica's KV-cache usage
    prefixHit: float | None  # the replicas' mean


# -- over the registry --------------------------------------------------------------------


def _placements(models: Sequence[ModelDefinition]) -> list[Placement]:
    """The models' placements with their nodes: the ones a list page prefetched
    (``prefetch_related("placements__node")``), else one query."""
    if all("placements" in getattr(m, "_prefetched_objects_cache", {}) for m in models):
        return [p for m in models for p in m.placements.all()]
    ids = [m.pk for m in models]
    return list(Placement.objects.filter(model_id__in=ids).select_related("node"))


def model_flags(models: Sequence[ModelDefinition], now: float | None = None) -> dict[int, Flags]:
    """Each model's warnings: flagged when any Ready replica is (:func:`replica_flags`).

    Three reads whatever the count: the placements (one query), the nodes' statuses
    (one MGET) and the nodes' stored flags (one MGET).
    """
    out: dict[int, Flags] = {m.pk: CLEAR for m in models}
    placements = _placements(models)
    if not placements:
        return out
    statuses = node_status.read_many({p.node.node_id: p.node for p in placements}.values())
    replicas = ((p.model_id, p.node.node_id, p.instance_id) for p in placements)
    return out | replica_flags(replicas, statuses, now)


_READY = InstanceState.READY  # an enum member read from its class costs a lookup each time


def is_ready(serving: bool, instance: Mapping[str, Any] | None) -> bool:
    """Whether a replica counts for the flags: its node serves (``serving``:
    ``nodes.status.is_serving`` of its effective status) and it is Ready there."""
    return serving and instance is not None and instance.get("state") == _READY


def replica_flags(
    replicas: Iterable[tuple[int, str, str]],
    statuses: dict[str, NodeStatus],
    now: float | None = None,
) -> dict[int, Flags]:
    """The flagged models only, from their replicas (model id, node id, instance id) and
    the nodes' effective statuses: a replica counts when it :func:`is_ready`; one MGET of
    the stored flags of those replicas' nodes, each node read once and shared by every
    model placed on it (:func:`ready_flags`)."""
    # Each serving node's instances, looked up once per node (a list passes every replica
    # of its page).
    serving = {
        node_id: status.get("instances") or {}
        for node_id, status in statuses.items()
        if node_status.is_serving(status)
    }
    ready: list[tuple[int, str, str]] = []
    for model_id, node_id, instance_id in replicas:
        instances = serving.get(node_id)
        if is_ready(instances is not None, (instances or {}).get(instance_id)):
            ready.append((model_id, node_id, instance_id))
    return ready_flags(ready, now)


def ready_flags(
    ready: Sequence[tuple[int, str, str]], now: float | None = None
) -> dict[int, Flags]:
    """:func:`replica_flags` over replicas known to be Ready on a serving node (the
    Overview finds them in its one pass over the registry): one MGET of their nodes'
    stored flags."""
    now = time.time() if now is None else now
    stored = stalls.flags_many(sorted({node_id for _, node_id, _ in ready}), now)
    out: dict[int, Flags] = {}
    for model_id, node_id, instance_id in ready:
        found = stored[node_id].get(instance_id)
        if found is None:
            continue
        current = out.get(model_id, CLEAR)
        if found["stalled"] and not current["stalled"]:
            out[model_id] = Flags(
                stalled=True,
                slow=current["slow"],
                reason=f"On {node_id}: {found['reason']}",
            )
        elif found["slow"] and not current["slow"]:
            out[model_id] = Flags(
                stalled=current["stalled"],
                slow=True,
                reason=current["reason"] or f"On {node_id}: {found['reason']}",
            )
    return out


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def merge(buckets: dict[float, list[EnginePoint]]) -> list[ModelPoint]:
    """The model's points from its replicas' engine values, by time bucket (pure)."""
    out: list[ModelPoint] = []
    for t in sorted(buckets):
        engines = buckets[t]
        memory = [e["rss"] for e in engines if e["rss"] is not None]
        kv = [e["kv"] for e in engines if e["kv"] is not None]
        hits = [e["prefixHit"] for e in engines if e["prefixHit"] is not None]
        out.append(
            ModelPoint(
                t=t,
                memory=sum(memory) if memory else None,
                running=_sum([e["running"] for e in engines]),
                waiting=_sum([e["waiting"] for e in engines]),
                promptTps=_sum([e["promptTps"] for e in engines]),
                genTps=_sum([e["genTps"] for e in engines]),
                kv=max(kv) if kv else None,
                prefixHit=sum(hits) / len(hits) if hits else None,
            )
        )
    return out


def model_series(
    model: ModelDefinition, window: Window, now: float | None = None
) -> list[ModelPoint]:
    """The model's KPIs over the last hour (5 s) or 24 hours (1 min), oldest first.

    Replicas on different nodes sample at different moments: their points are put in
    buckets of the window's step (5 s or 1 min) and summed per bucket. A hole in the
    history (nodes.telemetry.series) stays a point of Nones.
    """
    placements = _placements([model])
    node_ids = sorted({p.node.node_id for p in placements})
    history = telemetry.series_many(node_ids, window, now)
    step = telemetry.INTERVAL_SECONDS if window == "1h" else telemetry.COARSE_STEP_SECONDS
    buckets: dict[float, dict[str, EnginePoint]] = {}
    for placement in placements:
        for point in history.get(placement.node.node_id, []):
            bucket = math.floor(point["t"] / step) * step
            engine = point["engines"].get(placement.instance_id) or empty_engine()
            # A replica with two samples in one bucket (jitter) counts with its last.
            buckets.setdefault(bucket, {})[placement.instance_id] = engine
    return merge({t: list(by_instance.values()) for t, by_instance in buckets.items()})


def latest_many(
    models: Sequence[ModelDefinition], now: float | None = None
) -> dict[int, ModelPoint]:
    """Each model's current values over its replicas, from its nodes' newest points.

    For a list of many models: one placements query and one Redis pipeline for all of
    them (``model_series`` reads an hour per model). A node whose newest point is over a
    minute old counts as not reporting (``telemetry.latest_many``); a model none of whose
    replicas reports has no entry.
    """
    placements = _placements(models)
    points = telemetry.latest_many(sorted({p.node.node_id for p in placements}), now)
    engines: dict[int, list[EnginePoint]] = {}
    times: dict[int, float] = {}
    for placement in placements:
        point = points.get(placement.node.node_id)
        engine = point["engines"].get(placement.instance_id) if point else None
        if point is None or engine is None:
            continue
        engines.setdefault(placement.model_id, []).append(engine)
        times[placement.model_id] = max(times.get(placement.model_id, 0.0), point["t"])
    return {model_id: merge({times[model_id]: found})[0] for model_id, found in engines.items()}
