"""Keep every web process's key and route caches honest, through the Channels layer.

Each router process caches key lookups and routes (a database query per request
would cost more than the whole proxy hop). A change to a key, a model
definition, a placement or a node is announced on the ``router.invalidate``
group once the transaction commits; every router process listens on its own
channel in that group and drops what the change touches. So a revoked key
stops working everywhere as soon as the message arrives (milliseconds), and
the caches' TTLs are only the fallback for a lost message, not the mechanism.

Node statuses (read from Redis) are cached for a second per process (and served
for one more while a read refreshes them), and dropped at once when the monitor
publishes a change of that node on the ``fleet`` group, which this listener also
joins.

The group membership is refreshed every ``REJOIN_SECONDS`` because
channels_redis expires group members it has not seen for a day.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Literal, TypedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger("mirbad.router")

GROUP = "router.invalidate"
# The console's fleet group carries the monitor's node and instance changes, which
# is exactly when a cached node status goes stale.
GROUPS = (GROUP, "fleet")
REJOIN_SECONDS = 3600.0


class Invalidate(TypedDict):
    """What changed: every key, or the routes of one served name (None: all)."""

    type: Literal["router.invalidate"]
    kind: Literal["keys", "routes"]
    name: str | None


class NodeChanged(TypedDict):
    """A node's identity as the router must now dial it: its pins, or gone (revoked or
    deleted). The router retires connections made under any other pins."""

    type: Literal["router.invalidate"]
    kind: Literal["node"]
    node: int
    pins: list[str]
    gone: bool


def announce(kind: Literal["keys", "routes"], name: str | None = None) -> None:
    """Tell every router process, after the current transaction commits."""
    _send_on_commit(kind, dict(Invalidate(type="router.invalidate", kind=kind, name=name)))


def announce_node(node: int, pins: list[str], *, gone: bool) -> None:
    """Tell every router process a node's current pins, after the transaction commits."""
    message = NodeChanged(type="router.invalidate", kind="node", node=node, pins=pins, gone=gone)
    _send_on_commit("node", dict(message))


def _send_on_commit(kind: str, message: dict[str, Any]) -> None:
    def send() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async_to_sync(layer.group_send)(GROUP, message)
        except Exception:  # the TTL still bounds how long a stale entry lives
            log.warning("Could not announce a %s change to the routers", kind, exc_info=True)

    transaction.on_commit(send)


class Listener:
    """Receives invalidations for one router process and applies them."""

    def __init__(self, *, apply: Callable[[dict[str, Any]], None]) -> None:
        self.apply = apply
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="router-invalidation")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        backoff = 1.0
        while True:
            try:
                channel = await layer.new_channel()
                for group in GROUPS:
                    await layer.group_add(group, channel)
                self.ready.set()
                loop = asyncio.get_running_loop()
                rejoin_at = loop.time() + REJOIN_SECONDS
                backoff = 1.0
                while True:
                    timeout = max(1.0, rejoin_at - loop.time())
                    try:
                        message = await asyncio.wait_for(layer.receive(channel), timeout)
                    except TimeoutError:
                        for group in GROUPS:
                            await layer.group_add(group, channel)
                        rejoin_at = loop.time() + REJOIN_SECONDS
                        continue
                    self.apply(message)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Redis away: caches fall back to their TTL until we are back.
                self.ready.clear()
                log.warning("Router invalidation listener failed; retrying", exc_info=True)
                for kind in ("keys", "routes", "statuses"):
                    self.apply({"kind": kind, "name": None})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
