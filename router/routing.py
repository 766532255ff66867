"""Resolve a served name to a ready replica, from the registry and the status cache.

Nothing here calls an agent: placement comes from the database (cached for a
couple of seconds per process), liveness from the Redis status cache.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from models_registry.models import ModelDefinition
from nodes import status_cache
from nodes.models import Node
from nodes.states import NodeState
from router import errors, keys

ROUTE_TTL = 2.0
KEY_TTL = 10.0


@dataclass(frozen=True)
class Replica:
    node: Node
    instance_id: str


@dataclass(frozen=True)
class Route:
    model_id: int
    served_name: str
    replicas: tuple[Replica, ...]


class RoutingTable:
    """Per-process caches of keys and routes, refreshed on expiry."""

    def __init__(self) -> None:
        self._routes: dict[str, tuple[float, Route | None]] = {}
        self._keys: dict[str, tuple[float, keys.KeyInfo | None]] = {}
        self.in_flight: dict[str, int] = {}

    async def key(self, token: str) -> keys.KeyInfo | None:
        now = time.monotonic()
        hit = self._keys.get(token)
        if hit is not None and hit[0] > now:
            info = hit[1]
            return info if info is None or keys.still_valid(info) else None
        info = await sync_to_async(keys.lookup)(token)
        if len(self._keys) > 10_000:
            self._keys.clear()
        self._keys[token] = (now + KEY_TTL, info)
        return info

    async def route(self, served_name: str) -> Route | None:
        now = time.monotonic()
        hit = self._routes.get(served_name)
        if hit is not None and hit[0] > now:
            return hit[1]
        route = await sync_to_async(_load_route)(served_name)
        if len(self._routes) > 10_000:
            self._routes.clear()
        self._routes[served_name] = (now + ROUTE_TTL, route)
        return route

    async def ready_models(self) -> list[str]:
        names = await sync_to_async(_all_served_names)()
        ready = []
        for name in names:
            route = await self.route(name)
            if route is not None and await self._ready(route):
                ready.append(name)
        return ready

    async def _ready(self, route: Route) -> list[Replica]:
        out = []
        for replica in route.replicas:
            status = await status_cache.aread(replica.node.node_id)
            if status is None or status.get("state") not in (
                NodeState.ONLINE.value,
                NodeState.DEGRADED.value,
            ):
                continue
            inst = (status.get("instances") or {}).get(replica.instance_id)
            if inst is not None and inst.get("state") == "Ready":
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
        # Nothing ready: say why, from the first replica's node.
        first = route.replicas[0]
        status = await status_cache.aread(first.node.node_id)
        state = status.get("state") if status else NodeState.OFFLINE.value
        if state == NodeState.INCOMPATIBLE.value:
            raise errors.node_incompatible(route.served_name, first.node.node_id)
        if state not in (NodeState.ONLINE.value, NodeState.DEGRADED.value):
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
    return Route(model_id=model.pk, served_name=model.served_name, replicas=replicas)


def _all_served_names() -> list[str]:
    return list(ModelDefinition.objects.values_list("served_name", flat=True))
