"""The console's websockets: each forwards the typed events of the groups its page shows
(nodes/events.py).

``/ws/fleet/`` carries every node's and model's events. A page that shows only some of
them (a page of the Nodes or Models list, the Overview's first rows) says which after it
connects, and then receives only theirs (docs/operator-guide.md, "The console"):

    {"type": "subscribe", "nodes": ["gpu-a", ...], "models": [12, ...],
     "pending": true, "summary": true}

- ``nodes``, ``models``: the ids the page shows, at most ``SUBSCRIBE_MAX_IDS`` each; a
  node's ``node.updated``, ``node.certificate`` and ``download.updated``, a model's
  ``model.updated``, are forwarded only when its id is listed. Events about neither
  (``restore.updated``) pass as before.
- ``pending``: also forward ``node.updated`` of nodes waiting for approval (a node that
  enrolls appears on the page with its Approve button).
- ``summary``: for every event held back, send ``{"type": "fleet.changed"}`` instead,
  at most once per ``SUMMARY_SECONDS`` (the Overview's tiles and Needs attention count
  the whole fleet and render again on it).

The consumer answers ``{"type": "subscribed", "nodes": N, "models": M}``; each subscribe
replaces the one before (a page sends it again after it renders its rows again). A page
that never subscribes receives every event (Downloads, Restore). A message that is not a
valid subscribe (over ``SUBSCRIBE_MAX_BYTES``, not JSON, an unknown field, a bad id, too
many ids) is answered ``{"type": "subscribe.refused", "message": ...}`` and the socket is
closed with 4400: the page's script is wrong, and a silent full fan-out would hide it
(docs/decisions.md (Websocket fan-out: the page subscribes to what it shows)).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from redis.exceptions import RedisError

from nodes import fanout
from nodes.events import FLEET_GROUP, node_group
from nodes.states import NodeState
from protocol.names import NODE_ID_RE

log = logging.getLogger("mirbad.console")

SUBSCRIBE_MAX_BYTES = 64 * 1024
SUBSCRIBE_MAX_IDS = 1000
SUMMARY_SECONDS = 2.0
REFUSED = 4400
_FIELDS = frozenset({"type", "nodes", "models", "pending", "summary"})


class SubscribeRefused(ValueError):
    """A subscribe message the consumer does not accept; the message says why."""


@dataclass(frozen=True, slots=True)
class Subscription:
    """What a page shows: events of other nodes and models are held back."""

    nodes: frozenset[str]
    models: frozenset[int]
    pending: bool = False
    summary: bool = False

    def wants(self, event: dict[str, Any]) -> bool:
        """Whether the page shows what ``event`` is about (events about no node or model,
        such as ``restore.updated``, always)."""
        kind = event.get("type")
        if kind == "model.updated":
            return (event.get("model") or {}).get("modelId") in self.models
        if kind == "node.updated":
            node = event.get("node") or {}
            if node.get("nodeId") in self.nodes:
                return True
            return self.pending and node.get("state") == NodeState.PENDING_APPROVAL.value
        if kind == "node.certificate":
            return (event.get("certificate") or {}).get("nodeId") in self.nodes
        if kind in ("download.updated", "node.telemetry"):
            return event.get("nodeId") in self.nodes
        return True


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise SubscribeRefused(f"{name}: true or false")
    return value


def parse_subscribe(text: str) -> Subscription:
    """A page's subscribe message, checked (``SubscribeRefused`` says what is wrong)."""
    if len(text) > SUBSCRIBE_MAX_BYTES:
        raise SubscribeRefused(f"a message is at most {SUBSCRIBE_MAX_BYTES} characters")
    try:
        body = json.loads(text)
    except ValueError:
        raise SubscribeRefused("not JSON") from None
    if not isinstance(body, dict) or body.get("type") != "subscribe":
        raise SubscribeRefused('the only message is {"type": "subscribe", ...}')
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise SubscribeRefused(f"unknown field(s): {', '.join(unknown)[:100]}")
    nodes, models = body.get("nodes", []), body.get("models", [])
    if not isinstance(nodes, list) or not isinstance(models, list):
        raise SubscribeRefused("nodes and models: lists of ids")
    if len(nodes) > SUBSCRIBE_MAX_IDS or len(models) > SUBSCRIBE_MAX_IDS:
        raise SubscribeRefused(f"nodes and models: at most {SUBSCRIBE_MAX_IDS} ids each")
    if not all(isinstance(n, str) and NODE_ID_RE.fullmatch(n) for n in nodes):
        raise SubscribeRefused("nodes: node ids (lower-case letters, digits and '-')")
    if not all(type(m) is int and m > 0 for m in models):
        raise SubscribeRefused("models: model ids (whole numbers above 0)")
    return Subscription(
        nodes=frozenset(nodes),
        models=frozenset(models),
        pending=_flag(body, "pending"),
        summary=_flag(body, "summary"),
    )


class _PageConsumer(AsyncJsonWebsocketConsumer):
    """Operators only (4401 otherwise); joins ``groups()`` and forwards their events."""

    groups_joined: list[str]

    def page_groups(self) -> list[str] | None:
        """The groups of the page, or None when the URL names nothing valid (4404)."""
        raise NotImplementedError

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4401)
            return
        groups = self.page_groups()
        if groups is None:
            await self.close(code=4404)
            return
        self.groups_joined = groups
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def console_event(self, message: dict[str, Any]) -> None:
        await self.send_json(message["event"])

    async def console_batch(self, message: dict[str, Any]) -> None:
        """Events sent together (nodes.events.publish_batch): each as if sent alone."""
        for event in message["events"]:
            await self.console_event({"type": "console.event", "event": event})


class FleetConsumer(_PageConsumer):
    """``/ws/fleet/``: every node's and model's events, or those of what the page shows
    once it subscribes (the module's docstring)."""

    subscription: Subscription | None = None
    _summary: asyncio.Task[None] | None = None

    watching = False

    def page_groups(self) -> list[str] | None:
        return [FLEET_GROUP]

    async def connect(self) -> None:
        await super().connect()
        if getattr(self, "groups_joined", None):
            # The monitor builds the models' rows only while a fleet page is open.
            try:
                await fanout.awatch(fanout.FLEET_WATCHER, self.channel_name)
                self.watching = True
            except (RedisError, OSError):
                log.warning("Fleet page: registering it with the monitor failed")

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        # Checked before any parse: the size bound holds whatever the frame holds.
        try:
            if text_data is None:
                raise SubscribeRefused("send text, not bytes")
            self.subscription = parse_subscribe(text_data)
        except SubscribeRefused as exc:
            await self.send_json({"type": "subscribe.refused", "message": str(exc)})
            await self.close(code=REFUSED)
            return
        await self.send_json(
            {
                "type": "subscribed",
                "nodes": len(self.subscription.nodes),
                "models": len(self.subscription.models),
            }
        )

    async def console_event(self, message: dict[str, Any]) -> None:
        event = message["event"]
        wanted = self.subscription
        if wanted is None or wanted.wants(event):
            await self.send_json(event)
        elif wanted.summary and self._summary is None:
            self._summary = asyncio.create_task(self._changed_later())

    async def _changed_later(self) -> None:
        """One ``fleet.changed`` for every event held back in the next ``SUMMARY_SECONDS``."""
        try:
            await asyncio.sleep(SUMMARY_SECONDS)
            await self.send_json({"type": "fleet.changed"})
        finally:
            self._summary = None

    async def disconnect(self, code: int) -> None:
        if self.watching:
            with contextlib.suppress(RedisError, OSError):
                await fanout.aunwatch(fanout.FLEET_WATCHER, self.channel_name)
        if self._summary is not None:
            self._summary.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._summary
        await super().disconnect(code)


class NodeConsumer(_PageConsumer):
    """``/ws/nodes/<id>/``: one node's events (its page)."""

    watching: str | None = None

    def page_groups(self) -> list[str] | None:
        node_id = self.scope["url_route"]["kwargs"].get("node_id", "")
        return [node_group(node_id)] if NODE_ID_RE.fullmatch(node_id) else None

    async def connect(self) -> None:
        await super().connect()
        if getattr(self, "groups_joined", None):
            # The monitor sends a node's page events only while a page watches it.
            node_id = self.scope["url_route"]["kwargs"]["node_id"]
            try:
                await fanout.awatch(node_id, self.channel_name)
                self.watching = node_id
            except (RedisError, OSError):
                log.warning("Node page %s: registering it with the monitor failed", node_id)

    async def disconnect(self, code: int) -> None:
        if self.watching is not None:
            with contextlib.suppress(RedisError, OSError):
                await fanout.aunwatch(self.watching, self.channel_name)
        await super().disconnect(code)
