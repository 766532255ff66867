"""The console's websockets: each forwards the typed events of the groups its page shows
(nodes/events.py)."""

from __future__ import annotations

from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from nodes.events import FLEET_GROUP, node_group
from protocol.names import NODE_ID_RE


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


class FleetConsumer(_PageConsumer):
    """``/ws/fleet/``: every node's and model's events (Overview)."""

    def page_groups(self) -> list[str] | None:
        return [FLEET_GROUP]


class NodeConsumer(_PageConsumer):
    """``/ws/nodes/<id>/``: one node's events (its page)."""

    def page_groups(self) -> list[str] | None:
        node_id = self.scope["url_route"]["kwargs"].get("node_id", "")
        return [node_group(node_id)] if NODE_ID_RE.fullmatch(node_id) else None
