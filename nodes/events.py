"""Typed websocket events and the Channels groups they go to.

Groups are per scope: ``fleet`` (the Overview), ``node.<id>`` and
``model.<id>``, so a page subscribes only to what it shows.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, TypedDict

from channels.layers import get_channel_layer

log = logging.getLogger("mirbad.events")

FLEET_GROUP = "fleet"


def node_group(node_id: str) -> str:
    return f"node.{node_id}"


def model_group(model_id: int) -> str:
    return f"model.{model_id}"


class NodeSummary(TypedDict):
    nodeId: str
    state: str
    reasons: list[str]
    cpuPercent: float | None
    memoryPercent: float | None
    memoryUsedBytes: int | None
    memoryTotalBytes: int | None
    lastSeen: float | None


class ModelSummary(TypedDict):
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


Event = NodeUpdated | ModelUpdated | DownloadUpdated


async def publish(groups: list[str], event: Event) -> None:
    """Send ``event`` to each group; the consumer forwards it to the browser as JSON."""
    layer = get_channel_layer()
    if layer is None:
        return
    message: dict[str, Any] = {"type": "console.event", "event": dict(event)}
    for group in groups:
        try:
            await layer.group_send(group, message)
        except Exception:  # a full channel or Redis blip must not stop the monitor
            log.warning("Could not publish %s to %s", event["type"], group, exc_info=True)
