"""Load on demand in the router: a request for a stopped model starts it and waits.

When no candidate can take a request and a candidate has ``loadOnDemand``
(router.serving.Serving.serve), :meth:`Loader.wait` starts that model and waits for a Ready
replica, up to the model's ``loadTimeoutSeconds``:

- **Once**: per process one driver task per served name; across processes a Redis
  lock (``mirbad:ondemand:loading:<name>``, SET NX with an expiry past the load
  timeout) lets one driver call the start (models_registry.ondemand.start_on_demand:
  admission as for any start, an idle on-demand model stopped to make room). The
  others watch the same status cache the router routes by.
- **Failure**: a start refused, or every replica Failed after the launch, puts the
  reason (with the engine's last log lines) under ``mirbad:ondemand:failed:<name>``
  for :data:`HOLD_SECONDS`: every waiting request, in every process, answers
  ``503 model_failed`` with it, and so does every request until the key expires
  (no retry for a minute).
- **Timeout**: ``503 model_load_timeout``; the load itself goes on.

Waiting counts as queued time; a streamed request gets SSE comment lines meanwhile
(router.serving.Serving._load_on_demand).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings

from core.errors import ServiceError
from models_registry import ondemand as lifecycle_ondemand
from nodes import audit, status_cache
from protocol.states import InstanceState
from router import errors, queue
from router.errors import V1Error
from router.routing import Route, RoutingTable

log = logging.getLogger("mirbad.router")

LOCK_PREFIX = "mirbad:ondemand:loading:"
FAILED_PREFIX = "mirbad:ondemand:failed:"
HOLD_SECONDS = 60
POLL_SECONDS = 0.25
LOG_LINES = 12
LINE_MAX = 300
# The in-flight and last-use readers of the fair queue (Redis, every web process).
USAGE = lifecycle_ondemand.Usage(busy=queue.busy_slots, last_used=queue.last_used)
# With the queue off nothing counts requests: every model is taken as busy, so none is
# stopped for room or when idle (it might be serving).
UNKNOWN = lifecycle_ondemand.Usage(busy=lambda name: 1, last_used=lambda name: None)


def usage() -> lifecycle_ondemand.Usage:
    """The readers to decide by: the queue's, or UNKNOWN when it is off."""
    return USAGE if settings.MIRBAD.queue_enabled else UNKNOWN


# Deletes the lock only while it is still this driver's (it may have expired and been
# taken by another process's driver meanwhile).
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
_EXPIRED = "expired"

Starter = Callable[[int, str], dict[str, Any]]


def start(model_id: int, actor: str) -> dict[str, Any]:
    """The start, in a worker thread: attributed to the key whose request asked for it."""
    with audit.acting_as(f"{actor} (load on demand)"):
        return lifecycle_ondemand.start_on_demand(model_id, usage=usage())


class Loader:
    """Starts models on demand and waits for them; one per event loop and table."""

    def __init__(
        self, table: RoutingTable, redis: aioredis.Redis, starter: Starter | None = None
    ) -> None:
        self.table = table
        self.redis = redis
        self.starter = starter or start
        self._drivers: dict[str, asyncio.Task[V1Error | str | None]] = {}

    async def wait(
        self,
        route: Route,
        *,
        actor: str,
        tick: Callable[[], Awaitable[None]] | None = None,
        first_tick: float = 1.0,
        every: float = 5.0,
    ) -> float:
        """Start ``route``'s model if nobody is starting it, and wait until a replica is
        Ready; answers the seconds waited. ``tick`` runs ``first_tick`` s into the wait,
        then every ``every`` s (a stream's keep-alive)."""
        name = route.served_name
        if not route.replicas:
            raise errors.model_unplaced(name)
        began = time.monotonic()
        deadline = began + route.load_timeout
        next_tick = began + first_tick
        while True:
            driver = self._drivers.get(name)
            if driver is None or driver.done():
                driver = asyncio.ensure_future(self._drive(route, actor))
                self._drivers[name] = driver
            now = time.monotonic()
            wake = min(deadline, next_tick) if tick is not None else deadline
            try:
                outcome = await asyncio.wait_for(asyncio.shield(driver), max(0.0, wake - now))
            except TimeoutError:
                now = time.monotonic()
                if now >= deadline:
                    raise errors.model_load_timeout(name, route.load_timeout) from None
                if tick is not None:
                    await tick()
                    next_tick = now + every
                continue
            if outcome is None:
                return time.monotonic() - began
            if isinstance(outcome, V1Error):
                raise outcome
            # The driver's own deadline passed (it began before this request): go on.

    async def held(self, name: str) -> tuple[str, int] | None:
        """Why ``name`` failed to load lately and the seconds left of its hold, if it did."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(FAILED_PREFIX + name)
        pipe.ttl(FAILED_PREFIX + name)
        why, ttl = await pipe.execute()
        if why is None:
            return None
        return str(why), int(ttl) if isinstance(ttl, int) and ttl > 0 else 1

    async def _drive(self, route: Route, actor: str) -> V1Error | str | None:
        """Until Ready (None), failed (the error) or the load timeout ("expired"): start
        the model when this process wins the lock, and watch its replicas."""
        name = route.served_name
        deadline = time.monotonic() + route.load_timeout
        token = secrets.token_hex(8)
        lock = LOCK_PREFIX + name
        mine = False
        starter: asyncio.Future[dict[str, Any]] | None = None
        before: dict[str, tuple[Any, ...]] = {}
        began = time.monotonic()
        try:
            while time.monotonic() < deadline:
                held = await self.held(name)
                if held is not None:
                    return errors.model_failed(name, held[0], held[1])
                if await self.table.ready_replicas(route):
                    if starter is not None:
                        self._loaded(name, time.monotonic() - began, starter)
                    return None
                if not mine:
                    expiry = int(route.load_timeout) + 60
                    mine = bool(await self.redis.set(lock, token, nx=True, ex=expiry))
                    if mine:
                        before = await self._snapshot(route)
                        log.info("Loading %s on demand (asked by %s)", name, actor)
                        began = time.monotonic()
                        run = sync_to_async(self.starter, thread_sensitive=False)
                        starter = asyncio.ensure_future(run(route.model_id, actor))
                if starter is not None and starter.done():
                    exc = starter.exception()
                    if exc is not None:
                        why = exc.message if isinstance(exc, ServiceError) else repr(exc)
                        return await self._hold(name, f"its start was refused: {why}")
                    failure = await self._failure(route, before)
                    if failure is not None:
                        return await self._hold(name, failure)
                await asyncio.sleep(POLL_SECONDS)
            return _EXPIRED
        finally:
            if mine:
                try:
                    await self.redis.eval(_RELEASE, 1, lock, token)
                except Exception as exc:  # the lock expires by itself
                    log.warning("Releasing the load lock of %s failed: %r", name, exc)

    def _loaded(self, name: str, seconds: float, starter: asyncio.Future[dict[str, Any]]) -> None:
        evicted = []
        if starter.done() and starter.exception() is None:
            evicted = list(starter.result().get("evicted") or [])
        room = f", after stopping {', '.join(evicted)} to make room" if evicted else ""
        log.info("Loaded %s on demand in %.1f s%s", name, seconds, room)

    async def _hold(self, name: str, why: str) -> V1Error:
        """Remember the failure for every process for a minute; answers its error."""
        try:
            await self.redis.set(FAILED_PREFIX + name, why, ex=HOLD_SECONDS)
        except Exception as exc:  # this process's waiters still get the answer
            log.warning("Recording the failed load of %s failed: %r", name, exc)
        log.warning("Loading %s on demand failed (not retried for %d s): %s",
                    name, HOLD_SECONDS, why)  # fmt: skip
        return errors.model_failed(name, why, HOLD_SECONDS)

    async def _instances(self, route: Route) -> dict[str, tuple[str, dict[str, Any] | None]]:
        """Each replica's (node id, instance record) from the status cache."""
        out: dict[str, tuple[str, dict[str, Any] | None]] = {}
        for replica in route.replicas:
            status = await self.table.status(replica.node.node_id)
            inst = ((status or {}).get("instances") or {}).get(replica.instance_id)
            out[replica.instance_id] = (replica.node.node_id, inst)
        return out

    async def _snapshot(self, route: Route) -> dict[str, tuple[Any, ...]]:
        """What each replica's record looked like before the start (an old Failed one
        must not count as this start's failure)."""
        return {i: _mark(inst) for i, (_, inst) in (await self._instances(route)).items()}

    async def _failure(self, route: Route, before: dict[str, tuple[Any, ...]]) -> str | None:
        """Why the model failed to load, once every replica Failed after the start."""
        reasons = []
        for instance_id, (node_id, inst) in (await self._instances(route)).items():
            if not inst or inst.get("state") != InstanceState.FAILED:
                return None
            if _mark(inst) == before.get(instance_id):
                return None  # still the record of an earlier start
            reasons.append(failure_text(node_id, inst))
        return "; ".join(reasons) if reasons else None


def _mark(inst: dict[str, Any] | None) -> tuple[Any, ...]:
    if not inst:
        return ()
    return (inst.get("state"), inst.get("startedAt"), inst.get("exitCode"), inst.get("error"),
            inst.get("restartCount"))  # fmt: skip


def failure_text(node_id: str, inst: dict[str, Any]) -> str:
    """The engine's error and its last log lines, as the agent reported them."""
    error = inst.get("error") or f"the engine exited (code {inst.get('exitCode')})"
    tail = [str(line)[:LINE_MAX] for line in (inst.get("logTail") or [])[-LOG_LINES:]]
    lines = ("\nThe engine's last log lines:\n" + "\n".join(tail)) if tail else ""
    return f"it failed on {node_id}: {error}{lines}"


_loaders: dict[tuple[int, int], Loader] = {}


def loader_for(table: RoutingTable) -> Loader:
    """The loader of this event loop and table (redis.asyncio clients belong to a loop)."""
    key = (id(asyncio.get_running_loop()), id(table))
    loader = _loaders.get(key)
    if loader is None:
        if len(_loaders) > 16:
            _loaders.clear()
        loader = _loaders[key] = Loader(table, status_cache.async_client())
    return loader
