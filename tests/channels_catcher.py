"""A listener of our own on the real channel layer: what was sent to some groups."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from channels.layers import get_channel_layer


class Catcher:
    """Joins ``groups`` on one new channel; :meth:`drain` answers what arrived."""

    def __init__(self, *groups: str) -> None:
        self.groups = groups
        self.layer = get_channel_layer()
        self.channel = ""

    async def __aenter__(self) -> Catcher:
        assert self.layer is not None
        self.channel = await self.layer.new_channel()
        for group in self.groups:
            await self.layer.group_add(group, self.channel)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for group in self.groups:
            await self.layer.group_discard(group, self.channel)

    async def drain(self, quiet: float = 0.5) -> list[dict[str, Any]]:
        """Every message until none arrived for ``quiet`` seconds; a ``console.batch``
        as the events it holds, as the console's consumers hand them on."""
        got = []
        while True:
            try:
                message = await asyncio.wait_for(self.layer.receive(self.channel), quiet)
            except TimeoutError:
                return got
            if message.get("type") == "console.batch":
                got += [{"type": "console.event", "event": e} for e in message["events"]]
            else:
                got.append(message)


def kinds(messages: list[dict[str, Any]]) -> list[str]:
    """Console events by their type, router invalidations by their kind."""
    return [str((m.get("event") or {}).get("type") or m.get("kind")) for m in messages]
