"""Load on demand and idle unload: the lifecycle's side (docs/operator-guide.md, "Serving").

A model with ``load_on_demand`` is started by the first /v1 request that asks for it
while it is stopped (router.ondemand calls :func:`start_on_demand`). Admission decides
as for any start; when the model does not fit on a node, an idle on-demand model on
that node is stopped to make room: no request in flight, the longest idle first, never
a pinned one. A model with ``idle_unload_seconds`` is stopped after that long without
a request (:func:`unload_idle`, every few seconds from the beat).

What is in flight and when a model was last asked for is the router's knowledge, read
from Redis by functions the caller passes in (:class:`Usage`): this layer sits below
the router and does not import it. Every stop says which model and why in the log, the
audit log (``model.unloaded``) and on the model (``auto_start_note``, shown on its
console row and page until it starts again).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.errors import ServiceError
from models_registry import lifecycle
from models_registry.models import ModelDefinition, Placement
from nodes import audit
from nodes import status as node_status
from protocol.states import InstanceState

log = logging.getLogger("mirbad.models")

# After a stop, the node's free memory is seen at its next heartbeat (every 5 s): the
# start is tried again for this long before another model is stopped.
ROOM_WAIT_SECONDS = 15.0
ROOM_RETRY_SECONDS = 1.0
# At most this many models are stopped for one start.
MAX_EVICTIONS = 4
# A replica that became Ready less than this long ago may not be in its node's free
# memory yet (the agent's heartbeat, every 5 s, carries it): admission would count its
# memory as free. A start on demand waits that long after the last Ready on its nodes.
SETTLE_SECONDS = 6.0


@dataclass(frozen=True)
class Usage:
    """The router's readers: requests in flight and the last request's Unix time."""

    busy: Callable[[str], int]
    last_used: Callable[[str], float | None]


@dataclass(frozen=True)
class Idle:
    """A running model's replica on a node, and how long it has had no request."""

    model: ModelDefinition
    placement: Placement
    idle_seconds: float


def _ready_at(instance: dict[str, Any]) -> float | None:
    value = instance.get("readyAt")
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def idle_seconds(served_name: str, instance: dict[str, Any], usage: Usage, now: float) -> float:
    """Seconds since the last request, or since the replica became Ready if later (a
    model started and not yet asked for is not idle since forever)."""
    since = max(usage.last_used(served_name) or 0.0, _ready_at(instance) or 0.0)
    return max(0.0, now - since) if since else float("inf")


def eviction_candidates(
    node_id: str, *, usage: Usage, exclude: int | None = None, now: float | None = None
) -> list[Idle]:
    """The models on ``node_id`` that may be stopped to make room, longest idle first.

    Only on-demand models (they come back by themselves when asked for), never a
    pinned one, never one with a request in flight, and only a Ready replica (one
    Starting is being loaded for someone).
    """
    now = time.time() if now is None else now
    placements = Placement.objects.select_related("model", "node").filter(
        node__node_id=node_id, model__load_on_demand=True, model__pinned=False
    )
    if exclude is not None:
        placements = placements.exclude(model_id=exclude)
    placements_list = list(placements)
    if not placements_list:
        return []
    status = node_status.read(placements_list[0].node)
    instances = status.get("instances") or {}
    out = []
    for placement in placements_list:
        inst = instances.get(placement.instance_id)
        if not inst or inst.get("state") != InstanceState.READY:
            continue
        name = placement.model.served_name
        if usage.busy(name) > 0:
            continue
        out.append(Idle(placement.model, placement, idle_seconds(name, inst, usage, now)))
    out.sort(key=lambda c: (-c.idle_seconds, c.model.served_name))
    return out


def _idle_text(seconds: float) -> str:
    return "never used since it was loaded" if seconds == float("inf") else f"idle {seconds:.0f} s"


def unload(victim: Idle, *, reason: str, why: str) -> None:
    """Stop one replica (the whole model when it has no other), and say so everywhere.

    ``reason`` is a word for the audit detail (``room`` or ``idle``); ``why`` is the
    sentence the log, the audit log and the model's note carry.
    """
    model, node_id = victim.model, victim.placement.node.node_id
    others = model.placements.exclude(pk=victim.placement.pk).exists()
    # One replica among several: the others keep running, so the model stays "running".
    lifecycle.stop_model(model.pk, node_id=node_id if others else None)
    at = dt.datetime.now(dt.UTC).strftime("%H:%M UTC")
    note = f"Stopped on {node_id} at {at}: {why}"
    ModelDefinition.objects.filter(pk=model.pk).update(auto_start_note=note[:500])
    audit.record("model.unloaded", node_id=node_id, subject=model.served_name,
                 modelId=model.pk, reason=reason, why=why,
                 idleSeconds=None if victim.idle_seconds == float("inf")
                 else round(victim.idle_seconds))  # fmt: skip
    log.info("Unloaded %s on %s: %s", model.served_name, node_id, why)


def start_on_demand(
    model_id: int,
    *,
    usage: Usage,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Start a model for a request: admission as for any start, and when it does not fit
    on a node, stop that node's longest idle on-demand model and try again.

    Answers lifecycle.start_model's answer plus ``evicted`` (the served names stopped).
    A refusal other than admission's, or admission's with nothing left to stop, is
    raised as it is (its message says why)."""
    evicted: list[str] = []
    stopped_at: float | None = None
    settle = unsettled_seconds(model_id)
    if settle > 0:
        sleep(settle)
    while True:
        try:
            answer = lifecycle.start_model(model_id)
        except ServiceError as exc:
            node_id = (exc.details or {}).get("node") if exc.code == "admission_refused" else None
            if not isinstance(node_id, str):
                raise
            if stopped_at is not None and clock() - stopped_at < ROOM_WAIT_SECONDS:
                # The node's free memory shows the stop at its next heartbeat.
                sleep(ROOM_RETRY_SECONDS)
                continue
            model = ModelDefinition.objects.get(pk=model_id)
            candidates = eviction_candidates(node_id, usage=usage, exclude=model_id)
            if not candidates or len(evicted) >= MAX_EVICTIONS:
                more = (
                    f" Stopped {', '.join(evicted)} to make room, still not enough."
                    if evicted
                    else " No idle on-demand model there could be stopped to make room "
                    "(pinned ones and ones with requests in flight are kept)."
                )
                raise ServiceError(exc.status, exc.code, exc.message + more,
                                   details=exc.details) from None  # fmt: skip
            victim = candidates[0]
            unload(
                victim,
                reason="room",
                why=f"made room for '{model.served_name}' ({_idle_text(victim.idle_seconds)})",
            )
            evicted.append(victim.model.served_name)
            stopped_at = clock()
            continue
        answer["evicted"] = evicted
        return answer


def unsettled_seconds(model_id: int, now: float | None = None) -> float:
    """How long until every replica that became Ready on the model's nodes is in their
    reported free memory (:data:`SETTLE_SECONDS` after the latest Ready)."""
    now = time.time() if now is None else now
    nodes = {p.node for p in Placement.objects.select_related("node").filter(model_id=model_id)}
    latest = 0.0
    for status in node_status.read_many(nodes).values():
        for inst in (status.get("instances") or {}).values():
            if inst.get("state") == InstanceState.READY:
                latest = max(latest, _ready_at(inst) or 0.0)
    return min(SETTLE_SECONDS, max(0.0, latest + SETTLE_SECONDS - now))


def unload_idle(*, usage: Usage, now: float | None = None) -> list[dict[str, Any]]:
    """Stop every replica idle for its model's ``idle_unload_seconds``; answers what
    was stopped. Pinned models are kept (docs/operator-guide.md, "Serving")."""
    now = time.time() if now is None else now
    models = list(
        ModelDefinition.objects.filter(idle_unload_seconds__isnull=False, pinned=False)
        .exclude(desired_state=ModelDefinition.Desired.STOPPED)
        .prefetch_related("placements__node")
    )
    if not models:
        return []
    statuses = node_status.read_many({p.node for m in models for p in m.placements.all()})
    out: list[dict[str, Any]] = []
    for model in models:
        assert model.idle_unload_seconds is not None
        if usage.busy(model.served_name) > 0:
            continue
        for placement in model.placements.all():
            status = statuses.get(placement.node.node_id) or {}
            inst = (status.get("instances") or {}).get(placement.instance_id)
            if not inst or inst.get("state") != InstanceState.READY:
                continue
            idle = idle_seconds(model.served_name, inst, usage, now)
            if idle < model.idle_unload_seconds or idle == float("inf"):
                continue  # inf: no time to count from (a Ready replica has readyAt)
            victim = Idle(model, placement, idle)
            try:
                unload(victim, reason="idle", why=f"no request for {idle:.0f} s "
                       f"(idleUnloadSeconds {model.idle_unload_seconds})")  # fmt: skip
            except ServiceError as exc:
                log.warning("Idle unload of %s on %s failed: %s", model.served_name,
                            placement.node.node_id, exc.message)  # fmt: skip
                continue
            out.append({"model": model.served_name, "node": placement.node.node_id,
                        "idleSeconds": round(idle)})  # fmt: skip
    return out
