"""The node status cache in Redis: what the monitor last learned about each node.

The monitor is the only writer. Web processes (the router, the console, /api)
read it, so every process sees one truth without asking an agent. A record
carries ``lastSeen``; readers treat a record older than the Offline threshold
as Offline even if the monitor died before it could say so.
"""

from __future__ import annotations

import json
import time
from typing import Any, TypedDict

import redis
import redis.asyncio as aioredis
from django.conf import settings

from nodes.states import OFFLINE_AFTER_SECONDS, SERVING, NodeState

KEY_PREFIX = "mirbad:node:"


class NodeStatus(TypedDict, total=False):
    nodeId: str
    state: str
    reasons: list[dict[str, str]]
    lastSeen: float | None
    lastError: str
    bootId: str
    agentVersion: str
    protocolVersion: int | None
    clockSkewSeconds: float | None
    telemetry: dict[str, Any]
    instances: dict[str, dict[str, Any]]
    updatedAt: float


def _key(node_id: str) -> str:
    return f"{KEY_PREFIX}{node_id}"


_sync_client: redis.Redis | None = None
_async_clients: dict[int, aioredis.Redis] = {}


def sync_client() -> redis.Redis:
    global _sync_client
    if _sync_client is None:
        _sync_client = redis.Redis.from_url(settings.MIRBAD.redis_url, decode_responses=True)
    return _sync_client


def async_client() -> aioredis.Redis:
    """One client per event loop (redis.asyncio pools are bound to their loop)."""
    import asyncio

    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        client = aioredis.Redis.from_url(settings.MIRBAD.redis_url, decode_responses=True)
        _async_clients[loop_id] = client
    return client


def effective(status: NodeStatus | None, now: float | None = None) -> NodeStatus | None:
    """Apply the Offline threshold at read time (a dead monitor writes nothing)."""
    if status is None:
        return None
    last = status.get("lastSeen")
    moment = time.time() if now is None else now
    if status.get("state") in SERVING and (last is None or moment - last > OFFLINE_AFTER_SECONDS):
        status = dict(status)  # type: ignore[assignment]
        status["state"] = NodeState.OFFLINE.value
    return status


def read(node_id: str) -> NodeStatus | None:
    raw = sync_client().get(_key(node_id))
    return effective(json.loads(raw)) if raw else None


def read_many(node_ids: list[str]) -> dict[str, NodeStatus | None]:
    if not node_ids:
        return {}
    raws = sync_client().mget([_key(n) for n in node_ids])
    return {
        n: (effective(json.loads(r)) if r else None) for n, r in zip(node_ids, raws, strict=True)
    }


async def aread(node_id: str) -> NodeStatus | None:
    raw = await async_client().get(_key(node_id))
    return effective(json.loads(raw)) if raw else None


def write(status: NodeStatus) -> None:
    status["updatedAt"] = time.time()
    # Expire long after Offline so a removed node's record does not linger forever.
    sync_client().set(_key(status["nodeId"]), json.dumps(status), ex=86400)


async def awrite(status: NodeStatus) -> None:
    status["updatedAt"] = time.time()
    await async_client().set(_key(status["nodeId"]), json.dumps(status), ex=86400)


def delete(node_id: str) -> None:
    sync_client().delete(_key(node_id))
