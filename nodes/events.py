"""Typed Channels messages and the groups they go to.

Three groups, each with its own listeners and payloads:

- ``fleet``: console events for the Overview (``FleetConsumer``). The monitor
  publishes ``node.updated``, ``model.updated`` and ``download.updated`` here;
  a rotation publishes ``node.certificate``.
- ``node.<id>``: the same node events for one node's page (``NodeConsumer``):
  ``node.updated``, ``node.certificate`` and ``download.updated`` of that node, and
  ``node.telemetry`` (the node's newest history point), which goes to this group only.
- ``router.invalidate``: what makes a router process's caches wrong. Registry
  changes (``router.signals``) send ``routes``/``keys``; the monitor sends
  ``status`` with a node id when a node's state or instances change. Only the
  routers' ``router.invalidation.Listener`` joins it.
- ``monitor``: registry changes the monitor must act on (approve, revoke, drain,
  maintenance, a new pin). Only the active monitor joins it; it recomputes the
  node's status, writes it and publishes it (docs/decisions.md D46).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from nodes.telemetry import Point

log = logging.getLogger("mirbad.events")

FLEET_GROUP = "fleet"
ROUTER_GROUP = "router.invalidate"
MONITOR_GROUP = "monitor"
# channels_redis expires group members it has not seen for a day: listeners rejoin.
REJOIN_SECONDS = 3600.0


# -- console events (fleet) -------------------------------------------------------------


class NodeSummary(TypedDict):
    nodeId: str
    state: str
    reasons: list[str]
    cpuPercent: float | None
    memoryPercent: float | None
    memoryUsedBytes: int | None
    memoryTotalBytes: int | None
    lastSeen: float | None
    approved: bool | None  # the registry's flags; None when the node is gone
    draining: bool | None
    maintenance: bool | None


class ModelSummary(TypedDict):
    """A model's row on the Overview: its state over all its replicas, as the page renders it."""

    modelId: int
    servedName: str
    state: str
    nodeId: str | None
    error: str | None
    restartCount: int
    measuredBytes: int | None


class NodeUpdated(TypedDict):
    type: Literal["node.updated"]
    node: NodeSummary


class ModelUpdated(TypedDict):
    type: Literal["model.updated"]
    model: ModelSummary


class DownloadUpdated(TypedDict):
    """A download's progress on a node: bytes done, total when known, rate."""

    type: Literal["download.updated"]
    nodeId: str
    download: dict[str, Any]


class RotationSummary(TypedDict):
    rotationId: str
    stage: str
    reason: str
    attempts: int
    lastError: str


class CertificateSummary(TypedDict):
    """A node's certificate as the console shows it (nodes.rotation.certificate_summary)."""

    nodeId: str
    serial: str
    notAfter: str | None  # ISO 8601, UTC
    renewAt: str | None
    renewalError: str
    rotation: RotationSummary | None  # the open one


class CertificateUpdated(TypedDict):
    type: Literal["node.certificate"]
    certificate: CertificateSummary


class NodeTelemetry(TypedDict):
    """A node's newest telemetry point (nodes.telemetry.arecord), every 5 s: for its page
    only, so the Overview's socket does not carry every node's charts."""

    type: Literal["node.telemetry"]
    nodeId: str
    point: Point


class RestoreUpdated(TypedDict):
    """A restore's fleet phase moved (backups.fleet_restore): its page renders it again."""

    type: Literal["restore.updated"]
    jobId: int
    state: str


Event = (
    NodeUpdated | ModelUpdated | DownloadUpdated | CertificateUpdated | NodeTelemetry
    | RestoreUpdated
)  # fmt: skip


def node_group(node_id: str) -> str:
    """The group of one node's page (node ids are Channels-safe: protocol.names)."""
    return f"node.{node_id}"


def _groups(event: Event) -> list[str]:
    if event["type"] == "node.updated":
        return [FLEET_GROUP, node_group(event["node"]["nodeId"])]
    if event["type"] == "node.certificate":
        return [FLEET_GROUP, node_group(event["certificate"]["nodeId"])]
    if event["type"] == "download.updated":
        return [FLEET_GROUP, node_group(event["nodeId"])]
    if event["type"] == "node.telemetry":
        return [node_group(event["nodeId"])]  # not the fleet: docs/decisions.md D63
    return [FLEET_GROUP]


async def publish(event: Event) -> None:
    """Send ``event`` to the console pages that show it; their consumers forward it to
    the browser as JSON."""
    for group in _groups(event):
        await publish_to(group, event)


async def publish_to(group: str, event: Event) -> None:
    """Send ``event`` to one of its groups only (nodes.fanout decides which)."""
    message: dict[str, Any] = {"type": "console.event", "event": dict(event)}
    await _send(group, message, event["type"])


async def publish_batch(group: str, batch: Sequence[Event]) -> None:
    """Several events in one message: the consumers hand each on as if sent alone, in
    order (nodes.fanout: the monitor's rows for ``fleet``, once a second)."""
    if batch:
        message = {"type": "console.batch", "events": [dict(e) for e in batch]}
        await _send(group, message, f"batch of {len(batch)} events")


def publish_after_commit(build: Callable[[], Event]) -> None:
    """From synchronous code: build the event once the transaction commits (so it says
    what was stored) and publish it."""
    transaction.on_commit(lambda: async_to_sync(publish)(build()))


# -- router invalidation (router.invalidate) --------------------------------------------


class RegistryChanged(TypedDict):
    """Every key, or the routes of one served name (None: all), changed in the database."""

    type: Literal["router.invalidate"]
    kind: Literal["keys", "routes"]
    name: str | None


class StatusChanged(TypedDict):
    """The monitor wrote a new state or new instances for this node."""

    type: Literal["router.invalidate"]
    kind: Literal["status"]
    nodeId: str


class PinsChanged(TypedDict):
    """A node's identity as the router must now dial it: its pins, or gone (revoked or
    deleted). The router retires connections made under any other pins (D44)."""

    type: Literal["router.invalidate"]
    kind: Literal["node"]
    node: int
    pins: list[str]
    gone: bool


Invalidation = RegistryChanged | StatusChanged | PinsChanged


async def invalidate_status(node_id: str) -> None:
    """Tell every router process to drop its cached status of ``node_id``."""
    message = StatusChanged(type="router.invalidate", kind="status", nodeId=node_id)
    await _send(ROUTER_GROUP, dict(message), "status change")


# -- monitor notifications (monitor) ----------------------------------------------------


class NodeChanged(TypedDict):
    """The registry row of ``nodeId`` changed: the monitor recomputes and publishes."""

    type: Literal["node.changed"]
    nodeId: str


def tell_monitor(node_id: str) -> None:
    """After the current transaction commits, tell the active monitor ``node_id`` changed.

    A monitor that is down misses it; its next refresh (every 5 s) and every reader's
    registry check (nodes.status.effective) still see the change.
    """

    def send() -> None:
        message = NodeChanged(type="node.changed", nodeId=node_id)
        async_to_sync(_send)(MONITOR_GROUP, dict(message), "node change")

    transaction.on_commit(send)


# -- sending and listening --------------------------------------------------------------


# group_send takes a connection from channels_redis's pool for each message, and that
# pool raises MaxConnectionsError past 100 connections instead of waiting: a thousand
# monitor workers publishing at once hit it, thousands of times a minute
# (docs/performance.md, "A fleet of a thousand machines"). Sends queue here instead.
SEND_CONCURRENCY = 32
_send_gates: dict[int, asyncio.Semaphore] = {}


async def tell_monitor_async(kind: str) -> None:
    """A message of ``kind`` for the monitor group, from async code (nodes.fanout)."""
    await _send(MONITOR_GROUP, {"type": kind}, kind)


def _send_gate() -> asyncio.Semaphore:
    """This event loop's gate (asyncio primitives belong to one loop)."""
    loop_id = id(asyncio.get_running_loop())
    gate = _send_gates.get(loop_id)
    if gate is None:
        if len(_send_gates) > 64:  # loops of finished tests, threads' async_to_sync
            _send_gates.clear()
        gate = _send_gates[loop_id] = asyncio.Semaphore(SEND_CONCURRENCY)
    return gate


async def _send(group: str, message: dict[str, Any], what: str) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async with _send_gate():
            await layer.group_send(group, message)
    except Exception:  # a full channel or a Redis blip must not stop the sender
        log.warning("Could not publish a %s to %s", what, group, exc_info=True)


async def listen(
    group: str,
    handle: Callable[[dict[str, Any]], Awaitable[None]],
    *,
    ready: asyncio.Event | None = None,
    lost: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Join ``group`` on a channel of our own and hand each message to ``handle``, forever.

    When the layer fails (Redis away), ``lost`` is awaited (messages may have been
    missed meanwhile) and the listener joins again with back-off (1 s doubling to
    30 s). ``ready`` is set while joined. Cancel the task to stop.
    """
    layer = get_channel_layer()
    if layer is None:
        return
    backoff = 1.0
    while True:
        try:
            channel = await layer.new_channel()
            await layer.group_add(group, channel)
            if ready is not None:
                ready.set()
            loop = asyncio.get_running_loop()
            rejoin_at = loop.time() + REJOIN_SECONDS
            backoff = 1.0
            while True:
                timeout = max(1.0, rejoin_at - loop.time())
                try:
                    message = await asyncio.wait_for(layer.receive(channel), timeout)
                except TimeoutError:
                    await layer.group_add(group, channel)
                    rejoin_at = loop.time() + REJOIN_SECONDS
                    continue
                await handle(message)
        except asyncio.CancelledError:
            raise
        except Exception:
            if ready is not None:
                ready.clear()
            log.warning("Listening on %s failed; joining again", group, exc_info=True)
            if lost is not None:
                with contextlib.suppress(Exception):
                    await lost()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
