"""The node status cache in Redis: what the monitor last learned about each node.

The monitor is the only writer (docs/decisions.md D46). Web processes (the
router, the console, /api) read it, so every process sees one truth without
asking an agent. The records are returned as stored: what a node *is* also
depends on the registry and on the record's age, and that rule is applied by
``nodes.status.effective``, which every reader goes through.

Reads never raise for a Redis that is down or stalled (docs/decisions.md
D37): they wait at most
``MIRBAD_REDIS_STATUS_TIMEOUT`` seconds, then answer each node's last status this
process read, marked ``statusSource: "last-known"`` with ``statusAsOf``, or an
``Unknown`` placeholder marked ``"unknown"`` when it never read one.
"""

from __future__ import annotations

import copy as copy_module
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, TypedDict

import orjson
import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from nodes.states import NodeState

log = logging.getLogger("mirbad.nodes")

KEY_PREFIX = "mirbad:node:"

# Where a status came from (the ``statusSource`` field; absent means live).
LIVE = "live"
LAST_KNOWN = "last-known"
UNKNOWN = "unknown"
# Fields only readers add; never written back to Redis.
READER_FIELDS = ("statusSource", "statusAsOf", "maintenanceLeft")
# After a failed read, reads skip Redis this long: each one would otherwise hold
# its caller (for sync views, the one thread every Django view and the router's
# database loads share) for the whole timeout while Redis is still away.
RETRY_AFTER_SECONDS = 2.0
# The monitor's write pool: enough for its workers' writes to overlap, few enough that
# Redis never sees a connection per node; a write waits at most this long for one.
ASYNC_POOL_CONNECTIONS = 32
ASYNC_POOL_WAIT_SECONDS = 20.0
LAST_KNOWN_MAX = 10_000  # nodes remembered per process (the registry is far smaller)


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
    downloads: dict[str, dict[str, Any]]  # by folder, as the agent reports them
    operations: list[dict[str, str]]  # the agent's operations not yet ended
    fencing: dict[str, Any] | None  # the epoch the agent accepted
    updatedAt: float
    statusSource: str  # reader-side only: LAST_KNOWN or UNKNOWN when Redis was unreachable
    statusAsOf: float | None  # reader-side only: when this process last read it live
    maintenanceLeft: float  # reader-side only: nodes.status.effective, from the registry


def _key(node_id: str) -> str:
    return f"{KEY_PREFIX}{node_id}"


_sync_client: redis.Redis | None = None
_async_clients: dict[int, aioredis.Redis] = {}
_read_client: redis.Redis | None = None
_async_read_clients: dict[int, aioredis.Redis] = {}


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
        # A blocking pool: the monitor's workers write at once after a restart (a
        # thousand nodes reconnecting), and redis-py's default pool raises
        # MaxConnectionsError past 100 connections instead of waiting for one; at 100
        # nodes that left nodes Offline (docs/performance.md, "A fleet of a thousand
        # machines"). A bounded pool queues the writes on a few connections instead.
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.MIRBAD.redis_url,
            decode_responses=True,
            max_connections=ASYNC_POOL_CONNECTIONS,
            timeout=ASYNC_POOL_WAIT_SECONDS,
        )
        client = aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool
        _async_clients[loop_id] = client
    return client


def _read_options() -> dict[str, Any]:
    """The status readers' client: a short timeout, and no retry (a fallback exists)."""
    timeout = settings.MIRBAD.redis_status_timeout
    # redis-py retries connection errors 10 times with backoff by default, which
    # turns a Redis that refuses or drops connections into seconds per read.
    return {
        "decode_responses": True,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }


def read_client() -> redis.Redis:
    """The client every status read uses (and /healthz's ping): gives up within the timeout."""
    global _read_client
    if _read_client is None:
        _read_client = redis.Redis.from_url(settings.MIRBAD.redis_url, **_read_options())
    return _read_client


def async_read_client() -> aioredis.Redis:
    """:func:`read_client` for the event loop, one per loop."""
    import asyncio

    loop_id = id(asyncio.get_running_loop())
    client = _async_read_clients.get(loop_id)
    if client is None:
        options = _read_options()
        options["retry"] = AsyncRetry(NoBackoff(), 0)
        client = aioredis.Redis.from_url(settings.MIRBAD.redis_url, **options)
        _async_read_clients[loop_id] = client
    return client


class _Memory:
    """This process's last live answer per node, and whether Redis is being skipped."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[float, NodeStatus | None]] = {}
        self.skip_until = 0.0  # monotonic
        self.failing = False
        self._lock = threading.Lock()  # sync views read from threads, the router from its loop

    def should_try(self) -> bool:
        return time.monotonic() >= self.skip_until

    def remember(self, answers: dict[str, NodeStatus | None]) -> None:
        now = time.time()
        with self._lock:
            if len(self.known) + len(answers) > LAST_KNOWN_MAX:
                self.known.clear()
            for node_id, status in answers.items():
                self.known[node_id] = (now, status)
            if self.failing:
                self.failing = False
                log.info("Redis answers status reads again")

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.skip_until = time.monotonic() + RETRY_AFTER_SECONDS
            if not self.failing:
                self.failing = True
                log.warning(
                    "Redis unreachable for node status reads (%s: %s); serving the last known "
                    "statuses, retrying every %.0f s",
                    type(exc).__name__,
                    exc,
                    RETRY_AFTER_SECONDS,
                )

    def last_known(self, node_ids: list[str]) -> dict[str, NodeStatus | None]:
        out: dict[str, NodeStatus | None] = {}
        for node_id in node_ids:
            entry = self.known.get(node_id)
            if entry is None:
                out[node_id] = {
                    "nodeId": node_id,
                    "state": NodeState.UNKNOWN.value,
                    "reasons": [],
                    "lastSeen": None,
                    "statusSource": UNKNOWN,
                    "statusAsOf": None,
                }
                continue
            read_at, status = entry
            # No record then meant Offline then; the copy says so explicitly, marked.
            offline: NodeStatus = {
                "nodeId": node_id,
                "state": NodeState.OFFLINE.value,
                "reasons": [],
                "lastSeen": None,
            }
            # Deep: callers may change what they get; the remembered one must not change.
            copy: NodeStatus = copy_module.deepcopy(status) if status else offline
            copy["statusSource"] = LAST_KNOWN
            copy["statusAsOf"] = read_at
            out[node_id] = copy
        return out

    def clear(self) -> None:
        with self._lock:
            self.known.clear()
            self.skip_until = 0.0
            self.failing = False


_memory = _Memory()

# What a status read can meet from a Redis that is down, stalled or restarting.
_UNREACHABLE = (redis.RedisError, OSError)


def reads_paused() -> bool:
    """Whether reads skip Redis now (it failed under RETRY_AFTER_SECONDS ago): the other
    readers of the read client (the telemetry history) skip it too, so a page with a
    stalled Redis waits for one timeout, not one per read."""
    return not _memory.should_try()


def read_failed(exc: BaseException) -> None:
    """A read of the read client failed: pause every reader for RETRY_AFTER_SECONDS."""
    _memory.failed(exc)


def _load(raw: str | bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:  # NaN, which json.dumps wrote before orjson did: as before
        return json.loads(raw)


def _decode(node_ids: list[str], raws: list[str | bytes | None]) -> dict[str, NodeStatus | None]:
    # orjson: a list of 1,000 nodes decodes 1,000 records (docs/performance.md, "A fleet
    # of a thousand machines"); what it writes, json reads, and the other way round.
    answers = {n: (_load(r) if r else None) for n, r in zip(node_ids, raws, strict=True)}
    _memory.remember(answers)
    return answers


def read_many(node_ids: list[str]) -> dict[str, NodeStatus | None]:
    """Each node's status; the last known ones (marked) when Redis does not answer in time."""
    if not node_ids:
        return {}
    if _memory.should_try():
        try:
            raws = read_client().mget([_key(n) for n in node_ids])
        except _UNREACHABLE as exc:
            _memory.failed(exc)
        else:
            return _decode(node_ids, raws)
    return _memory.last_known(node_ids)


def read(node_id: str) -> NodeStatus | None:
    """One node's status (see :func:`read_many`)."""
    return read_many([node_id])[node_id]


async def aread(node_id: str) -> NodeStatus | None:
    """:func:`read` for the event loop (the router)."""
    if _memory.should_try():
        try:
            raw = await async_read_client().get(_key(node_id))
        except _UNREACHABLE as exc:
            _memory.failed(exc)
        else:
            return _decode([node_id], [raw])[node_id]
    return _memory.last_known([node_id])[node_id]


def source(status: NodeStatus | None) -> str:
    """LIVE, LAST_KNOWN or UNKNOWN: where a status returned by a read came from."""
    return (status or {}).get("statusSource", LIVE)


def oldest_as_of(statuses: Mapping[str, NodeStatus | None]) -> tuple[bool, float | None]:
    """(any status not live, when the oldest last-known one was read) for a page's banner."""
    stale = [s for s in statuses.values() if source(s) != LIVE]
    times = [t for s in stale if s and (t := s.get("statusAsOf")) is not None]
    return bool(stale), (min(times) if times else None)


def forget() -> None:
    """Drop this process's last known statuses and retry Redis at once (tests)."""
    _memory.clear()


def _stored(status: NodeStatus) -> str:
    status["updatedAt"] = time.time()
    if any(field in status for field in READER_FIELDS):  # a last-known copy written back
        # A plain dict: the record less keys it declares, which a TypedDict cannot type.
        status = {k: v for k, v in status.items() if k not in READER_FIELDS}  # type: ignore[assignment]  # see above
    try:
        return orjson.dumps(status).decode()
    except TypeError:  # what orjson refuses (an integer past 64 bits from an agent): as before
        return json.dumps(status)


def write(status: NodeStatus) -> None:
    """:func:`awrite` for synchronous callers (tests set records with it)."""
    # Expire long after Offline so a removed node's record does not linger forever.
    sync_client().set(_key(status["nodeId"]), _stored(status), ex=86400)


async def awrite(status: NodeStatus) -> None:
    """Store a node's record; the monitor is the only caller (docs/decisions.md D46)."""
    await async_client().set(_key(status["nodeId"]), _stored(status), ex=86400)


def stage_write(status: NodeStatus, pipe: aioredis.client.Pipeline) -> None:
    """:func:`awrite` queued on ``pipe`` (the monitor's one transaction per sample)."""
    pipe.set(_key(status["nodeId"]), _stored(status), ex=86400)
