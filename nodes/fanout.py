"""The monitor's node events for the console, sent only as often and as far as pages need.

Every 5 s each node's telemetry changes its console row (CPU, memory, last seen) and
makes a history point for its page. Sent as they came, that was three Channels group
sends per node per sample, ``node.updated`` to ``fleet`` and to ``node.<id>`` and
``node.telemetry`` to ``node.<id>``: 600 a second at 1,000 nodes, each two Redis round
trips even when no page listens, about a third of the monitor's CPU (docs/performance.md,
"A fleet of a thousand machines"). :class:`Batched`, the monitor's:

- ``node.updated`` for ``fleet`` is kept per node, the newest only, and sent in one
  ``console.batch`` message per :data:`FLUSH_SECONDS` (the consumers hand each event on
  as before, so the browser sees the same events). A change of state is sent at once
  (``urgent``), and the pending rows go with it, in order.
- The models' rows (``model.updated``, built from the database at each change of an
  instance) are built only while a fleet page is open (it registers as
  :data:`FLEET_WATCHER`): during 5,000 starts they were a third of the monitor's time.
- ``node.updated`` and ``node.telemetry`` for ``node.<id>`` are sent only while a node
  page watches that node: each ``NodeConsumer`` registers in :data:`WATCH_KEY` (a sorted
  set of ``"<node> <channel>"`` by expiry) and leaves it when it closes; the monitor reads
  it every :data:`WATCH_REFRESH_SECONDS`. An entry a crashed web process left behind
  expires with the Channels group membership it stands for (a day): until then that
  node's events are sent as before, to nobody.

:class:`Direct` sends every event at once, as before: a worker made without a monitor
(tests, tools) uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import redis.exceptions

from nodes import events, status_cache
from nodes.telemetry import Point

log = logging.getLogger("mirbad.monitor")

WATCH_KEY = "mirbad:console:watching"
# What a fleet page (FleetConsumer) registers as: not a node id (those are lower-case
# letters, digits and '-'), so it cannot be mistaken for one.
FLEET_WATCHER = "_fleet"
# channels_redis forgets a group member after a day (its group_expiry): so does this.
WATCH_TTL_SECONDS = 86400.0
WATCH_REFRESH_SECONDS = 2.0
FLUSH_SECONDS = 1.0
# The monitor group's message that makes the monitor read the watch list now.
WATCH_CHANGED = "watch.changed"
# Events per console.batch message: a fleet's rows are a few hundred kilobytes.
BATCH_MAX = 250


def _member(node_id: str, channel: str) -> str:
    return f"{node_id} {channel}"


async def awatch(node_id: str, channel: str) -> None:
    """A node page opened (its consumer joined ``node.<id>``; ``FLEET_WATCHER`` for a
    fleet page): the monitor sends its events, told at once rather than at its next
    read of the list."""
    client = status_cache.async_client()
    await client.zadd(WATCH_KEY, {_member(node_id, channel): time.time() + WATCH_TTL_SECONDS})
    await events.tell_monitor_async(WATCH_CHANGED)


async def aunwatch(node_id: str, channel: str) -> None:
    await status_cache.async_client().zrem(WATCH_KEY, _member(node_id, channel))


async def awatched() -> set[str]:
    """The nodes some page watches now (expired entries are removed on the way)."""
    client = status_cache.async_client()
    now = time.time()
    async with client.pipeline(transaction=False) as pipe:
        pipe.zremrangebyscore(WATCH_KEY, "-inf", now)
        pipe.zrangebyscore(WATCH_KEY, now, "+inf")
        _, members = await pipe.execute()
    return {(m.decode() if isinstance(m, bytes) else str(m)).split(" ", 1)[0] for m in members}


class Fanout(Protocol):
    """Where a monitor worker sends its node's console events."""

    def fleet_watched(self) -> bool:
        """Whether some fleet page is open: the models' console rows (a database read per
        change) are worth building only then; a page that opens renders its own."""

    async def node_updated(self, summary: events.NodeSummary, *, urgent: bool = False) -> None:
        """The node's row changed; ``urgent``: its state or registry flags did."""

    async def node_telemetry(self, node_id: str, point: Point) -> None:
        """The node's newest history point, for its page."""


class Direct:
    """Every event sent at once to all its groups (nodes.events.publish)."""

    def fleet_watched(self) -> bool:
        return True

    async def node_updated(self, summary: events.NodeSummary, *, urgent: bool = False) -> None:
        await events.publish(events.NodeUpdated(type="node.updated", node=summary))

    async def node_telemetry(self, node_id: str, point: Point) -> None:
        await events.publish(
            events.NodeTelemetry(type="node.telemetry", nodeId=node_id, point=point)
        )


class Batched:
    """The monitor's: rows batched for ``fleet``, node pages' events only when watched.

    The first event starts a task that sends the batch every :data:`FLUSH_SECONDS` (at
    once after an urgent one) and reads the watch list every
    :data:`WATCH_REFRESH_SECONDS`; it ends when a flush finds nothing to send. Each step
    (:meth:`flush`, :meth:`refresh_watched`) is a method a test can call.
    """

    def __init__(self) -> None:
        self.pending: dict[str, events.NodeSummary] = {}
        self.watched: set[str] = set()
        self.watched_at: float | None = None  # time.monotonic() of the last read
        self._urgent = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def fleet_watched(self) -> bool:
        return self.watched_at is None or FLEET_WATCHER in self.watched

    async def node_updated(self, summary: events.NodeSummary, *, urgent: bool = False) -> None:
        node_id = summary["nodeId"]
        self.pending.pop(node_id, None)  # re-inserted last: the batch keeps arrival order
        self.pending[node_id] = summary
        if urgent:
            self._urgent.set()
        await self._running()
        if node_id in self.watched:
            event = events.NodeUpdated(type="node.updated", node=summary)
            await events.publish_to(events.node_group(node_id), event)

    async def node_telemetry(self, node_id: str, point: Point) -> None:
        await self._running()
        if node_id in self.watched:
            event = events.NodeTelemetry(type="node.telemetry", nodeId=node_id, point=point)
            await events.publish(event)

    async def flush(self) -> int:
        """Send the pending rows to ``fleet``; answers how many."""
        pending, self.pending = self.pending, {}
        rows = [events.NodeUpdated(type="node.updated", node=s) for s in pending.values()]
        for start in range(0, len(rows), BATCH_MAX):
            await events.publish_batch(events.FLEET_GROUP, rows[start : start + BATCH_MAX])
        return len(rows)

    async def refresh_watched(self) -> None:
        self.watched_at = time.monotonic()
        try:
            self.watched = await awatched()
        except (redis.exceptions.RedisError, OSError) as exc:
            # Keep the last answer: a Redis blip must not stop a watched page's events.
            log.warning("Reading the watched nodes failed: %s", exc)

    def _list_old(self) -> bool:
        """Whether the watch list was never read or is older than WATCH_REFRESH_SECONDS."""
        return (
            self.watched_at is None or time.monotonic() - self.watched_at >= WATCH_REFRESH_SECONDS
        )

    async def _running(self) -> None:
        """Start the sending task if none runs; read the watch list first if it is old
        (a worker's first event must not skip a page that is open)."""
        if self._task is not None and not self._task.done():
            return
        if self._list_old():
            await self.refresh_watched()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="monitor-fanout")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), FLUSH_SECONDS)
            self._urgent.clear()
            try:
                sent = await self.flush()
            except Exception:  # the next flush sends the newer rows
                log.exception("Monitor: sending the console rows failed")
                sent = -1
            if sent == 0:
                return  # idle: the next event starts it again
            if self._list_old():
                await self.refresh_watched()

    async def close(self) -> None:
        """Send what is pending and stop the task (the monitor is stopping)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.flush()
