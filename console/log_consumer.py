"""``/ws/nodes/<node_id>/logs/<name>/``: one log of one node, followed live (D62).

The consumer dials the node's agent itself (``nodes.agent_client.AsyncAgentClient``,
pinned mTLS): on connect it sends the node's list of logs and the last lines of the
chosen one, then long-polls the agent for the lines after the last it sent and
forwards each batch. When the agent cannot be reached it says so (``log.error``) and
tries again with back-off, from where it was; it stops when the socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Literal, TypedDict

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from nodes.agent_client import AgentError, AgentRefused, AsyncAgentClient
from nodes.models import Node
from protocol.names import INSTANCE_ID_RE, NODE_ID_RE

log = logging.getLogger("mirbad.console.logs")

AGENT_LOG = "agent"
FIRST_LINES = 500  # what the panel shows at once
BATCH_LINES = 1000  # at most per long-poll
LONG_POLL_SECONDS = 20  # under the agent's 25 s cap


class LogLine(TypedDict):
    seq: int
    text: str


class LogList(TypedDict):
    """The logs the node offers: ``{"name", "kind", ...}`` as the agent lists them."""

    type: Literal["log.list"]
    logs: list[dict[str, Any]]


class LogLines(TypedDict):
    """Lines of the followed log, oldest first; ``seq`` only grows within one agent run."""

    type: Literal["log.lines"]
    name: str
    lines: list[LogLine]


class LogError(TypedDict):
    """Why no lines come now (the agent is unreachable, the log is gone)."""

    type: Literal["log.error"]
    message: str


def valid_log_name(name: str) -> bool:
    """``agent`` or what can be an instance id (the agent decides whether it exists)."""
    return name == AGENT_LOG or (
        INSTANCE_ID_RE.fullmatch(name) is not None and name not in (".", "..")
    )


def _client_for(node_id: str) -> AsyncAgentClient | None:
    node = Node.objects.filter(node_id=node_id, approved=True, revoked=False).first()
    if node is None or not node.address:
        return None
    return AsyncAgentClient(node=node)


class LogConsumer(AsyncJsonWebsocketConsumer):
    """Operators only (4401); 4404 for a node or log name that names nothing."""

    retry_start = 1.0
    retry_max = 30.0

    follower: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4401)
            return
        kwargs = self.scope["url_route"]["kwargs"]
        self.node_id, self.log_name = kwargs.get("node_id", ""), kwargs.get("name", "")
        if not NODE_ID_RE.fullmatch(self.node_id) or not valid_log_name(self.log_name):
            await self.close(code=4404)
            return
        client = await sync_to_async(_client_for)(self.node_id)
        if client is None:
            await self.close(code=4404)
            return
        await self.accept()
        self.follower = asyncio.create_task(self._follow(client), name="log-follower")

    async def disconnect(self, code: int) -> None:
        if self.follower is not None:
            self.follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.follower
            self.follower = None

    async def _follow(self, client: AsyncAgentClient) -> None:
        after: int | None = None
        delay = self.retry_start
        try:
            while True:
                try:
                    if after is None:
                        # First, and again after a failure: the list may have changed.
                        logs = await client.logs()
                        await self.send_json(LogList(type="log.list", logs=logs))
                        batch = await client.log_lines(self.log_name, limit=FIRST_LINES)
                    else:
                        batch = await client.log_lines(
                            self.log_name, after=after, limit=BATCH_LINES, wait=LONG_POLL_SECONDS
                        )
                except AgentRefused as exc:
                    if exc.status == 404:
                        await self.send_json(
                            LogError(type="log.error", message=f"{self.node_id}: {exc.message}")
                        )
                        await self.close(code=4404)
                        return
                    await self._failed(str(exc), delay)
                    delay = min(delay * 2, self.retry_max)
                    after = None
                    continue
                except AgentError as exc:
                    await self._failed(str(exc), delay)
                    delay = min(delay * 2, self.retry_max)
                    # ``after`` stays: it goes on from the last line sent once the agent
                    # answers again (a restarted agent answers its last lines for a
                    # number it has not reached).
                    continue
                delay = self.retry_start
                lines = [LogLine(seq=int(x["seq"]), text=str(x["text"])) for x in batch["lines"]]
                if lines or after is None:
                    await self.send_json(
                        LogLines(type="log.lines", name=self.log_name, lines=lines)
                    )
                after = int(batch["next"])
        finally:
            await client.aclose()

    async def _failed(self, message: str, delay: float) -> None:
        await self.send_json(
            LogError(type="log.error", message=f"{message}; trying again in {delay:g} s")
        )
        await asyncio.sleep(delay)
