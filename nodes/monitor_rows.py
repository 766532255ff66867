"""The rows the monitor publishes for the console: a node's summary, its open
operations, and its models' rows with the memory measurements.

What an instance event costs after the status is in Redis (the model rows and the
measurement) runs off the event's path and coalesced.

Both need the database, and every database call of the monitor goes through the one
thread ``sync_to_async`` keeps for them. Awaited inside the event handler, a burst of
starts (a model started on many replicas, a master restart's auto-starts) queued each
node's next status write behind every other node's row queries: a Ready reached Redis
2.5 s (p50) and 5.5 s (p99) after the agent reported it with 100 nodes and 500 models
(docs/performance.md, "A fleet of a thousand machines"). Now the handler only marks
the model dirty; one task per node publishes the dirty models' rows in one query and
records the measurements, in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async

from nodes import events, hooks, status_cache
from nodes.models import Node
from nodes.states import NodeState

log = logging.getLogger("mirbad.monitor")


def node_summary(status: status_cache.NodeStatus, node: Node | None = None) -> events.NodeSummary:
    """The node's row data for the console; the registry flags come from ``node`` (a
    console row changes shape when they change: docs/decisions.md D68)."""
    telemetry = status.get("telemetry") or {}
    memory = telemetry.get("memory") or {}
    return events.NodeSummary(
        nodeId=status["nodeId"],
        state=status.get("state", NodeState.OFFLINE.value),
        reasons=[r.get("code", "") for r in status.get("reasons", [])],
        cpuPercent=telemetry.get("cpuPercent"),
        memoryPercent=memory.get("percent"),
        memoryUsedBytes=memory.get("usedBytes"),
        memoryTotalBytes=memory.get("totalBytes"),
        lastSeen=status.get("lastSeen"),
        approved=node.approved if node is not None else None,
        draining=node.draining if node is not None else None,
        maintenance=bool(node.maintenance_left()) if node is not None else None,
    )


def agent_operations(data: dict[str, Any]) -> list[dict[str, str]]:
    """The agent's operations not yet ended, as the console lists them (at most 50)."""
    found = data.get("operations")
    if not isinstance(found, list):
        return []
    return [
        {k: str(op.get(k) or "")[:100] for k in ("id", "kind", "instanceId", "openedAt")}
        for op in found[:50]
        if isinstance(op, dict)
    ]


async def publish_model_rows(node_id: str, model_ids: list[int] | None = None) -> None:
    """``model.updated`` for the models placed on the node, each over all its replicas."""
    try:
        rows = await sync_to_async(hooks.model_rows)(node_id, model_ids)
    except Exception:  # a console row must not drop the node's connection
        log.exception("Node %s: reading its models' rows failed", node_id)
        return
    for row in rows:
        await events.publish(events.ModelUpdated(type="model.updated", model=row))


class RowPublisher:
    """One node's pending model rows and measurements, worked off by one task."""

    def __init__(self, node_id: str, *, wanted: Callable[[], bool] = lambda: True) -> None:
        """``wanted``: whether the rows are worth building now (a fleet page is open);
        the measurements are recorded whatever it says."""
        self.node_id = node_id
        self.wanted = wanted
        self._models: set[int] = set()
        self._measurements: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def instance_changed(self, instance: dict[str, Any]) -> None:
        """Queue the model's row and, when the instance carries one, its measurement."""
        model_id = instance.get("modelId")
        if isinstance(model_id, int) and self.wanted():
            self._models.add(model_id)
        if instance.get("measured"):
            self._measurements.append(instance)
        if (self._models or self._measurements) and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._work(), name=f"rows-{self.node_id}")

    async def _work(self) -> None:
        while self._models or self._measurements:
            measurements, self._measurements = self._measurements, []
            for instance in measurements:
                await self._record(instance)
            models, self._models = sorted(self._models), set()
            if models:
                await publish_model_rows(self.node_id, models)

    async def _record(self, instance: dict[str, Any]) -> None:
        """Keep the instance's measured memory beside its budget (one row per start)."""
        try:
            await sync_to_async(hooks.record_measurement)(self.node_id, instance)
        except Exception:  # a bookkeeping failure must not drop the node's connection
            log.exception("Node %s: recording a memory measurement failed", self.node_id)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
