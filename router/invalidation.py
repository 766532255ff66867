"""Keep every web process's key, route and status caches honest, through the Channels layer.

Each router process caches key lookups and routes (a database query per request
would cost more than the whole proxy hop). A change to a key, a model
definition, a placement or a node is announced on the ``router.invalidate``
group once the transaction commits; every router process listens on its own
channel in that group and drops what the change touches. So a revoked key
stops working everywhere as soon as the message arrives (milliseconds), and
the caches' TTLs are only the fallback for a lost message, not the mechanism.

Node statuses (read from Redis) are cached for a second per process (and served
for one more while a read refreshes them), and dropped at once when the monitor
sends a ``status`` message for that node on the same group (it does so whenever
it writes a new state or new instances). The listener joins that group only:
the console's ``fleet`` events are not its business (docs/decisions.md D46).

A node's changed pins (rekey, revoke, delete) go on the same group as ``node``
messages: every router retires pooled connections made under other pins
(docs/decisions.md D44).

The payloads are typed in ``nodes.events`` (``RegistryChanged``, ``StatusChanged``,
``PinsChanged``),
where the monitor, below this app, can send them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Literal

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from nodes import events
from nodes.events import PinsChanged, RegistryChanged

log = logging.getLogger("mirbad.router")

GROUP = events.ROUTER_GROUP


def announce(kind: Literal["keys", "routes"], name: str | None = None) -> None:
    """Tell every router process, after the current transaction commits."""
    _send_on_commit(kind, dict(RegistryChanged(type="router.invalidate", kind=kind, name=name)))


def announce_node(node: int, pins: list[str], *, gone: bool) -> None:
    """Tell every router process a node's current pins, after the transaction commits."""
    message = PinsChanged(type="router.invalidate", kind="node", node=node, pins=pins, gone=gone)
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

    async def _handle(self, message: dict[str, Any]) -> None:
        self.apply(message)

    async def _lost(self) -> None:
        # Changes may have been missed while away: drop everything, reload on use.
        for kind in ("keys", "routes", "statuses"):
            self.apply({"kind": kind, "name": None})

    async def _run(self) -> None:
        await events.listen(GROUP, self._handle, ready=self.ready, lost=self._lost)
