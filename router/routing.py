"""Resolve a served name to a ready replica, from the registry and the status cache.

Nothing here calls an agent: placement comes from the database (cached for a
couple of seconds per process), liveness from the Redis status cache.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from asgiref.sync import sync_to_async

from models_registry.models import ModelDefinition
from models_registry.models import Route as AliasRow
from nodes import status as node_status
from nodes import status_cache
from nodes.models import Node
from nodes.states import NodeState
from protocol.states import InstanceState
from router import errors, keys

_T = TypeVar("_T")

# Changes arrive through router.invalidation within milliseconds; the TTLs only
# bound how long a lost message can leave an entry wrong.
log = logging.getLogger("mirbad.router")

ROUTE_TTL = 10.0
KEY_TTL = 10.0
STATUS_TTL = 1.0
# An entry expired less than this long ago is still served while one read refreshes
# it: a change of the node's status drops the entry (the monitor's status messages on
# router.invalidate), so only a missed message leaves it stale, for at most TTL + this.
STATUS_STALE = 1.0


@dataclass(frozen=True)
class Replica:
    node: Node
    instance_id: str


@dataclass(frozen=True)
class Route:
    model_id: int
    served_name: str
    replicas: tuple[Replica, ...]
    emulate_dimensions: bool = False  # a llama.cpp embedding model (docs/operator-guide.md, "/v1")
    # Serving policy (docs/operator-guide.md, "Serving"): each replica takes at most
    # ``capacity`` requests at once (llama.cpp's parallel slots, vLLM's max_num_seqs);
    # the rest wait in the model's fair queue (router.queue).
    capacity: int = 1
    queue_max: int | None = None  # None: MIRBAD_QUEUE_MAX
    queue_timeout: float | None = None  # None: MIRBAD_QUEUE_TIMEOUT
    load_on_demand: bool = False
    load_timeout: float = 300.0


class RoutingTable:
    """Per-process caches of keys and routes, refreshed on expiry."""

    def __init__(self) -> None:
        self._routes: dict[str, tuple[float, Route | None]] = {}
        # An alias's targets (served names, in order), None for a name that is none.
        self._aliases: dict[str, tuple[float, tuple[str, ...] | None]] = {}
        self._keys: dict[str, tuple[float, keys.KeyInfo | None]] = {}
        # Every served name, for /v1/models: one entry, dropped by any route change.
        self._names: dict[str, tuple[float, list[str]]] = {}
        self._statuses: dict[str, tuple[float, status_cache.NodeStatus | None]] = {}
        self._status_reads: dict[str, asyncio.Future[status_cache.NodeStatus | None]] = {}
        self._loads: dict[tuple[int, str], asyncio.Future[Any]] = {}
        self._generation = 0  # bumped by every key or route change
        self._status_generation = 0  # bumped by every status change
        self.in_flight: dict[str, int] = {}

    def invalidate(self, message: dict[str, Any]) -> None:
        """Apply a ``router.invalidate`` message (nodes.events; see router.invalidation)."""
        if message.get("kind") == "status":
            # The monitor wrote a new state or new instances for that node.
            node_id = message.get("nodeId")
            if isinstance(node_id, str):
                self._status_generation += 1
                self._statuses.pop(node_id, None)
            return
        if message.get("kind") in ("keys", "routes"):
            self._generation += 1
            self._loads.clear()  # loads under way may predate the change
        if message.get("kind") == "statuses":
            self._status_generation += 1
            self._statuses.clear()
        elif message.get("kind") == "keys":
            self._keys.clear()
        elif message.get("kind") == "routes":
            self._names.clear()  # a route added, renamed or removed changes the list
            name = message.get("name")
            if name is None:
                self._routes.clear()
                self._aliases.clear()
            else:
                self._routes.pop(name, None)
                self._aliases.pop(name, None)

    async def key(self, token: str) -> keys.KeyInfo | None:
        info = await self._cached(self._keys, token, KEY_TTL, keys.lookup)
        return info if info is None or keys.still_valid(info) else None

    async def route(self, served_name: str) -> Route | None:
        return await self._cached(self._routes, served_name, ROUTE_TTL, _load_route)

    async def candidates(self, name: str) -> list[Route]:
        """What a client's ``model`` names, in order of preference: the served name's
        route alone, or an alias's targets' routes (models_registry.routes), empty when
        unknown. A target whose model is gone is skipped (deleting one is refused)."""
        route = await self.route(name)
        if route is not None:
            return [route]
        targets = await self._cached(self._aliases, name, ROUTE_TTL, _load_alias)
        out = []
        for target in targets or ():
            target_route = await self.route(target)
            if target_route is not None:
                out.append(target_route)
        return out

    async def _cached(
        self,
        store: dict[str, tuple[float, _T]],
        name: str,
        ttl: float,
        load: Callable[[str], _T],
    ) -> _T:
        """A cached database answer: one load at a time per name, stale ones served meanwhile.

        The TTL only guards against a lost invalidation (changes drop entries at once),
        so an expired entry is still answered while one background load replaces it.
        Without that, every request in flight when an entry expired queued its own
        query on the one database thread: at c=64 that was a 300 ms stall every 10 s.
        """
        hit = store.get(name)
        if hit is not None:
            if hit[0] <= time.monotonic():
                self._load(store, name, ttl, load)
            return hit[1]
        return await asyncio.shield(self._load(store, name, ttl, load))

    def _load(
        self,
        store: dict[str, tuple[float, _T]],
        name: str,
        ttl: float,
        load: Callable[[str], _T],
    ) -> asyncio.Future[_T]:
        flight = (id(store), name)
        pending = self._loads.get(flight)
        if pending is None:
            generation = self._generation

            async def run() -> _T:
                value = await sync_to_async(load)(name)
                # A change announced while the query ran may not be in its answer: then
                # it is not kept, and the next request loads again.
                if generation == self._generation:
                    if len(store) > 10_000:
                        store.clear()
                    store[name] = (time.monotonic() + ttl, value)
                return value

            pending = asyncio.ensure_future(run())
            self._loads[flight] = pending
            pending.add_done_callback(lambda f: self._loaded(flight, f))
        return pending

    def _loaded(self, flight: tuple[int, str], future: asyncio.Future[Any]) -> None:
        if self._loads.get(flight) is future:
            del self._loads[flight]
        if not future.cancelled() and future.exception() is not None:
            # A waiting request sees it; a background refresh only logs it. Never the
            # name: for the key cache it is the client's plaintext API key.
            log.warning("Loading a cached route or key failed: %r", future.exception())

    async def ready_models(self) -> list[str]:
        """The served names with a ready replica, then the aliases with at least one
        ready target, from the caches (no query per call)."""
        names = await self._cached(self._names, "", ROUTE_TTL, _all_served_names)
        ready = []
        for name in names:
            route = await self.route(name)
            if route is not None and await self._ready(route):
                ready.append(name)
        # "\0" is no served name (router.app refuses a NUL in ``model``).
        for alias in await self._cached(self._names, "\0aliases", ROUTE_TTL, _all_alias_names):
            for target in await self.candidates(alias):
                if await self._ready(target):
                    ready.append(alias)
                    break
        return ready

    async def status(self, node_id: str) -> status_cache.NodeStatus | None:
        """A node's status record, cached briefly here and dropped when the monitor reports a change.

        The record as stored; :meth:`_effective` applies the rule of ``nodes.status``.

        One read per node at a time: when the entry expires under load, hundreds of
        requests miss together, and a read each would exhaust Redis's connection
        pool (measured at c=256). They all wait on the one read instead; and an entry
        that expired just now is served while that read runs, so no request waits
        for Redis on the routine refresh (it did, about once a second, on the path
        to the first chunk). A stalled Redis holds a read for at most
        MIRBAD_REDIS_STATUS_TIMEOUT, and its answer is then the last known status,
        which is served at once, whatever its age, until a read succeeds again.
        """
        now = time.monotonic()
        hit = self._statuses.get(node_id)
        if hit is not None and hit[0] > now:
            return hit[1]
        pending = self._status_reads.get(node_id)
        if pending is None:
            pending = asyncio.ensure_future(self._read_status(node_id, hit))
            self._status_reads[node_id] = pending
            pending.add_done_callback(self._status_read_done(node_id))
        if hit is not None and now - hit[0] < STATUS_STALE:
            return hit[1]
        if hit is not None and status_cache.source(hit[1]) != status_cache.LIVE:
            # Already a last-known copy (Redis is stalled): waiting for a read that is
            # likely to time out again would only add the timeout to this request.
            return hit[1]
        return await asyncio.shield(pending)

    def _status_read_done(self, node_id: str) -> Callable[[asyncio.Future[Any]], None]:
        def done(future: asyncio.Future[Any]) -> None:
            self._status_reads.pop(node_id, None)
            if not future.cancelled():
                future.exception()  # a refresh nobody awaited must not log "never retrieved"

        return done

    async def _read_status(
        self, node_id: str, previous: tuple[float, status_cache.NodeStatus | None] | None
    ) -> status_cache.NodeStatus | None:
        generation = self._status_generation
        failure: Exception | None = None
        try:
            # Redis away or stalled: within the status timeout this is the last status
            # this process read (kept, not dropped to Offline: /v1 keeps serving), or
            # an Unknown placeholder when it never read one.
            status = await status_cache.aread(node_id)
        except Exception as exc:
            status, failure = None, exc
        if failure is not None or status_cache.source(status) == status_cache.UNKNOWN:
            if previous is not None:
                why = repr(failure) if failure is not None else "Redis unreachable"
                log.warning("Node status of %s unreadable (%s); using the last one", node_id, why)
                return previous[1]
            raise errors.V1Error(
                503, "server_busy", "Node statuses cannot be read right now.", retry_after=5
            ) from failure
        if generation == self._status_generation:  # else it may predate a change
            self._statuses[node_id] = (time.monotonic() + STATUS_TTL, status)
        return status

    async def _effective(self, node: Node) -> status_cache.NodeStatus:
        """The node's effective status (nodes.status.effective) from the cached record."""
        return node_status.effective(node, await self.status(node.node_id))

    async def ready_replicas(self, route: Route) -> list[Replica]:
        """The replicas of ``route`` that take traffic now, from the status cache."""
        return await self._ready(route)

    async def _ready(self, route: Route) -> list[Replica]:
        out = []
        for replica in route.replicas:
            status = await self._effective(replica.node)
            if not node_status.takes_traffic(status):
                continue  # not serving, or held by a job or an operator (maintenance)
            inst = (status.get("instances") or {}).get(replica.instance_id)
            if inst is not None and inst.get("state") == InstanceState.READY:
                out.append(replica)
        return out

    async def pick(self, route: Route, exclude: set[str] | None = None) -> Replica:
        """The ready replica with the fewest requests in flight here, ties at random."""
        if not route.replicas:
            raise errors.model_unplaced(route.served_name)
        ready = [r for r in await self._ready(route) if r.instance_id not in (exclude or set())]
        if ready:
            least = min(self.in_flight.get(r.instance_id, 0) for r in ready)
            return random.choice(
                [r for r in ready if self.in_flight.get(r.instance_id, 0) == least]
            )
        # Nothing ready: say why. A maintenance hold first: it says when to come back.
        held = [r.node for r in route.replicas if r.node.maintenance_until is not None]
        held = [n for n in held if n.maintenance_left()]
        if held:
            node = min(held, key=lambda n: n.maintenance_left())
            raise errors.maintenance(
                route.served_name, node.node_id, node.maintenance_left(), node.maintenance_reason
            )
        first = route.replicas[0]
        status = await self._effective(first.node)
        if node_status.state_of(status) == NodeState.INCOMPATIBLE.value:
            raise errors.node_incompatible(route.served_name, first.node.node_id)
        if not node_status.is_serving(status):
            raise errors.node_offline(route.served_name, first.node.node_id)
        raise errors.model_not_ready(route.served_name)


def _load_route(served_name: str) -> Route | None:
    model = (
        ModelDefinition.objects.filter(served_name=served_name)
        .prefetch_related("placements__node")
        .first()
    )
    if model is None:
        return None
    replicas = tuple(
        Replica(node=p.node, instance_id=p.instance_id)
        for p in model.placements.all()
        if not p.node.revoked and p.node.approved
    )
    settings = model.settings or {}
    emulate = (
        model.runtime == ModelDefinition.Runtime.LLAMACPP
        and bool(settings.get("embedding"))
        and settings.get("emulate_dimensions", True) is not False
    )
    return Route(
        model_id=model.pk,
        served_name=model.served_name,
        replicas=replicas,
        emulate_dimensions=emulate,
        capacity=_capacity(model),
        queue_max=model.queue_max_length,
        queue_timeout=model.queue_timeout_seconds,
        load_on_demand=model.load_on_demand,
        load_timeout=float(model.load_timeout_seconds),
    )


def _capacity(model: ModelDefinition) -> int:
    """Requests one replica serves at once: llama.cpp's ``parallel``, vLLM's
    ``max_num_seqs`` (their defaults when unset, as the engine would use)."""
    settings = model.settings or {}
    if model.runtime == ModelDefinition.Runtime.VLLM:
        value = settings.get("max_num_seqs", 64)
    else:
        value = settings.get("parallel", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _all_served_names(_: str = "") -> list[str]:
    return list(ModelDefinition.objects.values_list("served_name", flat=True))


def _all_alias_names(_: str = "") -> list[str]:
    return list(AliasRow.objects.values_list("name", flat=True))


def _load_alias(name: str) -> tuple[str, ...] | None:
    targets = AliasRow.objects.filter(name=name).values_list("targets", flat=True).first()
    if not isinstance(targets, list):
        return None
    return tuple(t for t in targets if isinstance(t, str))
