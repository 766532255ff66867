"""The fleet's families on ``/metrics``, beside the router's own (router.metrics).

``FleetCollector`` is a prometheus_client collector that reads, at each scrape,
the registry (nodes, models, placements), each node's effective status
(nodes.status) and its newest telemetry point (nodes.telemetry.latest_many).
Telemetry values come only from points :func:`nodes.telemetry.is_current`
accepts: a node whose last sample is over a minute old has no CPU, memory, GPU or
model values at all (stale is absent, never the last value). Label values come
from the registry only (node ids, served names, a GPU's index, node state names,
disk paths that pass :data:`DISK_PATH`), never from free text.

The families (docs/decisions.md D64):

==================================================  ==============================
``mirbad_node_state``                                node, state (1 for the node's
                                                     effective state, 0 others)
``mirbad_node_certificate_expiry_timestamp_seconds``  node
``mirbad_node_cpu_percent``                          node
``mirbad_node_memory_used_bytes``                    node
``mirbad_node_memory_total_bytes``                   node
``mirbad_node_load1``                                node
``mirbad_node_disk_free_bytes``                      node, path
``mirbad_node_disk_total_bytes``                     node, path
``mirbad_node_gpu_memory_used_bytes``                node, gpu
``mirbad_node_gpu_memory_total_bytes``               node, gpu
``mirbad_node_gpu_utilization_percent``              node, gpu
``mirbad_model_memory_bytes``                        model, node (the engine's RSS)
``mirbad_model_requests_running``                    model, node
``mirbad_model_requests_waiting``                    model, node
``mirbad_model_prompt_tokens_per_second``            model, node
``mirbad_model_generation_tokens_per_second``        model, node
``mirbad_model_kv_cache_usage_ratio``                model, node
``mirbad_model_prefix_cache_hit_ratio``              model, node
``mirbad_model_stalled``                             model (models_registry.kpis)
``mirbad_model_slow``                                model
``mirbad_queue_depth``                               (none): requests waiting, fleet
``mirbad_router_queue_depth``                        model (router.queue's line)
``mirbad_router_queue_last_wait_seconds``            model
==================================================  ==============================

A scrape is a few database queries and Redis round trips whatever the fleet's
size (:data:`MAX_NODES` nodes, :data:`MAX_MODELS` models at most); ``/metrics``
runs it in a thread, one at a time per process (:func:`arender`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from models_registry import kpis
from models_registry.models import ModelDefinition, Placement
from nodes import status as node_status
from nodes import telemetry
from nodes.models import Node
from nodes.states import NodeState
from router import queue as fair_queue

__all__ = ["FleetCollector", "SessionVerdict", "arender", "families", "render", "session_verdict"]

log = logging.getLogger("mirbad.router")

MAX_NODES = 1000  # the monitor follows at most this many (nodes.monitor.Monitor)
MAX_MODELS = 5000
MAX_DISKS = 8  # per node
# A disk path is the agent's, so it is checked before it becomes a label.
DISK_PATH = re.compile(r"^/[A-Za-z0-9._/-]{0,199}$")
STATES = tuple(s.value for s in NodeState)


def _gauge(name: str, documentation: str, labels: Sequence[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=list(labels))


def _add(family: GaugeMetricFamily, labels: list[str], value: float | int | None) -> None:
    if value is not None:  # unknown is absent, never 0
        family.add_metric(labels, float(value))


def families(now: float | None = None) -> list[Metric]:
    """Every fleet family, read now from the database and Redis (call from a thread)."""
    now = time.time() if now is None else now
    nodes = list(Node.objects.order_by("node_id")[: MAX_NODES + 1])
    if len(nodes) > MAX_NODES:
        log.warning("/metrics: more than %d nodes; the rest are left out", MAX_NODES)
        nodes = nodes[:MAX_NODES]
    statuses = node_status.read_many(nodes)
    points = telemetry.latest_many([n.node_id for n in nodes], now)

    state = _gauge("mirbad_node_state", "1 for the node's effective state.", ("node", "state"))
    expiry = _gauge(
        "mirbad_node_certificate_expiry_timestamp_seconds",
        "When the node's certificate expires (Unix time).",
        ("node",),
    )
    cpu = _gauge("mirbad_node_cpu_percent", "The node's CPU use, percent of all cores.", ("node",))
    mem_used = _gauge("mirbad_node_memory_used_bytes", "The node's memory in use.", ("node",))
    mem_total = _gauge("mirbad_node_memory_total_bytes", "The node's memory.", ("node",))
    load1 = _gauge("mirbad_node_load1", "The node's 1-minute load average.", ("node",))
    disk_free = _gauge(
        "mirbad_node_disk_free_bytes", "Free space on the agent's disks.", ("node", "path")
    )
    disk_total = _gauge(
        "mirbad_node_disk_total_bytes", "Size of the agent's disks.", ("node", "path")
    )
    gpu_used = _gauge("mirbad_node_gpu_memory_used_bytes", "GPU memory in use.", ("node", "gpu"))
    gpu_total = _gauge("mirbad_node_gpu_memory_total_bytes", "GPU memory.", ("node", "gpu"))
    gpu_util = _gauge(
        "mirbad_node_gpu_utilization_percent", "GPU utilisation, percent.", ("node", "gpu")
    )
    for node in nodes:
        node_id = node.node_id
        current = node_status.state_of(statuses.get(node_id))
        for name in STATES:
            state.add_metric([node_id, name], 1.0 if name == current else 0.0)
        if node.cert_not_after is not None:
            expiry.add_metric([node_id], node.cert_not_after.timestamp())
        point = points.get(node_id)
        if point is None:
            continue
        _add(cpu, [node_id], point["cpu"])
        _add(mem_used, [node_id], point["memUsed"])
        _add(mem_total, [node_id], point["memTotal"])
        _add(load1, [node_id], point["load1"])
        for gpu in point["gpus"]:
            labels = [node_id, str(gpu["index"])]
            _add(gpu_used, labels, gpu["memUsed"])
            _add(gpu_total, labels, gpu["memTotal"])
            _add(gpu_util, labels, gpu["util"])
        record = statuses.get(node_id) or {}
        for disk in _disks(record.get("telemetry") or {}):
            _add(disk_free, [node_id, disk["path"]], disk.get("freeBytes"))
            _add(disk_total, [node_id, disk["path"]], disk.get("totalBytes"))

    models = list(ModelDefinition.objects.order_by("served_name")[: MAX_MODELS + 1])
    if len(models) > MAX_MODELS:
        log.warning("/metrics: more than %d models; the rest are left out", MAX_MODELS)
        models = models[:MAX_MODELS]
    model_families = _model_families(models, points, now)
    return [
        state,
        expiry,
        cpu,
        mem_used,
        mem_total,
        load1,
        disk_free,
        disk_total,
        gpu_used,
        gpu_total,
        gpu_util,
        *model_families,
    ]


def _disks(sample: dict[str, Any]) -> list[dict[str, Any]]:
    disks = sample.get("disks")
    out = []
    for disk in disks if isinstance(disks, list) else []:
        if isinstance(disk, dict) and isinstance(disk.get("path"), str):
            if DISK_PATH.fullmatch(disk["path"]) and ".." not in disk["path"].split("/"):
                out.append(disk)
        if len(out) >= MAX_DISKS:
            break
    return out


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _model_families(
    models: list[ModelDefinition], points: dict[str, telemetry.Point | None], now: float
) -> list[Metric]:
    labels = ("model", "node")
    memory = _gauge("mirbad_model_memory_bytes", "The engine's resident memory.", labels)
    running = _gauge("mirbad_model_requests_running", "Requests the engine is running.", labels)
    waiting = _gauge("mirbad_model_requests_waiting", "Requests waiting in the engine.", labels)
    prompt = _gauge(
        "mirbad_model_prompt_tokens_per_second", "Prompt tokens processed per second.", labels
    )
    gen = _gauge(
        "mirbad_model_generation_tokens_per_second", "Tokens generated per second.", labels
    )
    kv = _gauge("mirbad_model_kv_cache_usage_ratio", "KV-cache usage, 0 to 1.", labels)
    prefix = _gauge("mirbad_model_prefix_cache_hit_ratio", "Prefix-cache hit rate.", labels)
    stalled = _gauge(
        "mirbad_model_stalled", "1 when a Ready replica is stalled (docs/decisions.md D64).",
        ("model",),
    )  # fmt: skip
    slow = _gauge("mirbad_model_slow", "1 when a Ready replica is slow.", ("model",))
    queue = _gauge("mirbad_queue_depth", "Requests waiting in the engines, whole fleet.", ())
    by_id = {m.pk: m for m in models}
    placements = Placement.objects.filter(model_id__in=list(by_id)).select_related("node")
    waiting_total: float | None = None
    for placement in placements:
        point = points.get(placement.node.node_id)
        engine = point["engines"].get(placement.instance_id) if point is not None else None
        if engine is None:
            continue
        pair = [by_id[placement.model_id].served_name, placement.node.node_id]
        _add(memory, pair, engine["rss"])
        _add(running, pair, engine["running"])
        _add(waiting, pair, engine["waiting"])
        _add(prompt, pair, engine["promptTps"])
        _add(gen, pair, engine["genTps"])
        _add(kv, pair, engine["kv"])
        _add(prefix, pair, engine["prefixHit"])
        if engine["waiting"] is not None:
            waiting_total = (waiting_total or 0.0) + engine["waiting"]
    for model_id, found in kpis.model_flags(models, now).items():
        name = by_id[model_id].served_name
        stalled.add_metric([name], 1.0 if found["stalled"] else 0.0)
        slow.add_metric([name], 1.0 if found["slow"] else 0.0)
    _add(queue, [], waiting_total)
    line = _gauge(
        "mirbad_router_queue_depth", "Requests waiting in the router's fair queue.", ("model",)
    )
    last_wait = _gauge(
        "mirbad_router_queue_last_wait_seconds",
        "How long the latest answered request waited in the fair queue.",
        ("model",),
    )
    for name, (depth, waited_ms) in fair_queue.snapshot([m.served_name for m in models]).items():
        line.add_metric([name], float(depth))
        _add(last_wait, [name], waited_ms / 1000 if waited_ms is not None else None)
    return [memory, running, waiting, prompt, gen, kv, prefix, stalled, slow, queue, line,
            last_wait]  # fmt: skip


class FleetCollector(Collector):
    """The fleet's families at each collection (the database and Redis: call from a thread)."""

    def collect(self) -> Iterator[Metric]:
        yield from families()

    def describe(self) -> list[Metric]:
        # Without describe() the registry would collect once when registering, which
        # reads the database at import time.
        return []


_registry = CollectorRegistry(auto_describe=False)
_registry.register(FleetCollector())
_scrape_lock: asyncio.Lock | None = None


def render() -> bytes:
    """The fleet's text exposition (synchronous: the database and Redis)."""
    close_old_connections()  # a thread of the pool keeps its connection between scrapes
    try:
        return generate_latest(_registry)
    finally:
        close_old_connections()


async def arender() -> bytes:
    """:func:`render` in a thread, one scrape at a time in this process."""
    global _scrape_lock
    if _scrape_lock is None:
        _scrape_lock = asyncio.Lock()
    async with _scrape_lock:
        return await sync_to_async(render, thread_sensitive=False)()


# -- a console session on /metrics --------------------------------------------------------

SessionVerdict = Literal["none", "anonymous", "user", "staff"]


class _SessionRequest:
    """What ``django.contrib.auth.get_user`` reads of a request: its session."""

    def __init__(self, session: Any) -> None:
        self.session = session


def session_verdict(cookie_header: str) -> SessionVerdict:
    """Whose console session the request's cookies carry (synchronous: the database).

    "none": no session cookie; "anonymous": an unknown, expired or logged-out session;
    "user": a logged-in user who is not an active staff member; "staff": an operator.
    The session is resolved as Django's own middleware does, the auth hash checked.
    """
    from importlib import import_module

    from django.contrib.auth import get_user
    from django.http.cookie import parse_cookie

    session_key = parse_cookie(cookie_header).get(settings.SESSION_COOKIE_NAME)
    if not session_key:
        return "none"
    engine = import_module(settings.SESSION_ENGINE)
    close_old_connections()
    try:
        user = get_user(_SessionRequest(engine.SessionStore(session_key)))  # type: ignore[arg-type]  # get_user reads .session only
        if not user.is_authenticated:
            return "anonymous"
        return "staff" if user.is_active and user.is_staff else "user"
    finally:
        close_old_connections()


async def asession_verdict(cookie_header: str) -> SessionVerdict:
    """:func:`session_verdict` in a thread."""
    return await sync_to_async(session_verdict, thread_sensitive=False)(cookie_header)
