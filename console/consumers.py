"""The console's websocket: forwards typed events of the groups a page asked for."""

from __future__ import annotations

from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from nodes.events import FLEET_GROUP


class FleetConsumer(AsyncJsonWebsocketConsumer):
    """``/ws/fleet/``: node.updated and model.updated for the whole fleet (Overview)."""

    groups_joined: list[str]

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4401)
            return
        self.groups_joined = [FLEET_GROUP]
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def console_event(self, message: dict[str, Any]) -> None:
        await self.send_json(message["event"])
