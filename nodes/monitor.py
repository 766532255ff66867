"""The monitor: one connection per approved node, feeding the status cache.

For each node a :class:`~nodes.monitor_worker.NodeWorker` takes ``/info`` and a full
``/status`` snapshot on every (re)connect, follows ``/events`` (whose heartbeats carry
the node's telemetry), and reconnects with back-off. Every change is written to the
Redis status cache (the monitor is its only writer), announced to the routers on
``router.invalidate`` when the state or the instances changed, and sent to the
console (``nodes.fanout``). Registry changes (approve, revoke, drain, maintenance, a new pin) reach the
monitor on the ``monitor`` group (docs/decisions.md D46). Each step is a method
a test can call on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from nodes import events, fencing, operations, status_cache
from nodes.fanout import WATCH_CHANGED, Batched
from nodes.models import Node
from nodes.monitor_rows import node_summary, publish_model_rows
from nodes.monitor_worker import NodeWorker
from nodes.states import NodeState, registry_state
from nodes.status_writer import GroupWriter

log = logging.getLogger("mirbad.monitor")

__all__ = ["HEARTBEAT_KEY", "Monitor", "NodeWorker", "heartbeat_age"]

# The active monitor writes the time into this key at every step of its loop (every
# refresh_interval, 5 s); /healthz calls it stale after three missed steps.
HEARTBEAT_KEY = "mirbad:monitor:heartbeat"
HEARTBEAT_STALE_AFTER = 15.0
# Open master operations are closed from the agent's records at each (re)connect and
# then this often: a lost answer leaves one open while the monitor's own connection
# to the node never dropped (docs/decisions.md D77).
RECONCILE_INTERVAL = 30.0
# The node list is read whole this often, as a backstop: every registry change reaches
# the monitor as a notification at once (D46), and the read of 1,000 nodes every 5 s
# was a query that grew with the fleet for nothing.
FULL_REFRESH_SECONDS = 30.0
# Workers (re)connecting at once: the TLS handshake, /info and /status of each.
CONNECT_CONCURRENCY = 32


def heartbeat_age(now: float | None = None) -> float | None:
    """Seconds since the active monitor's last step, or None if it never wrote one."""
    raw = status_cache.read_client().get(HEARTBEAT_KEY)  # a stalled Redis: error, no hang
    if raw is None:
        return None
    return (time.time() if now is None else now) - float(raw)


class Monitor:
    """Keeps one :class:`NodeWorker` per approved, enrolled node."""

    def __init__(
        self,
        *,
        refresh_interval: float = 5.0,
        full_refresh_interval: float = FULL_REFRESH_SECONDS,
        max_nodes: int = 1000,
    ) -> None:
        """Every ``refresh_interval`` the loop writes its heartbeat; the node list is read
        whole every ``full_refresh_interval`` (changes arrive as notifications)."""
        self.refresh_interval = refresh_interval
        self.full_refresh_interval = full_refresh_interval
        self.refreshed_at: float | None = None  # time.monotonic() of the last full read
        self.max_nodes = max_nodes
        self.stop = asyncio.Event()
        self.workers: dict[str, tuple[NodeWorker, asyncio.Task[None]]] = {}
        # The loop and registry notifications both refresh: one at a time.
        self._refreshing = asyncio.Lock()
        self.listening = asyncio.Event()  # joined the monitor group
        # A restart reconnects every node at once: bounded, the handshakes and snapshots
        # queue instead of starving the loop that keeps the connected ones alive.
        self.connect_gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
        self.fanout = Batched()
        self.writer = GroupWriter()  # every worker's records, one transaction a round trip
        self.reconciled_at = time.monotonic()  # every worker reconciles as it connects

    @sync_to_async
    def load_nodes(self, only: str | None = None) -> list[Node]:
        """The nodes to follow (``only``: that one, if it is to be followed)."""
        rows = Node.objects.filter(approved=True, revoked=False).exclude(
            spki_pin="", pending_pin=""
        )
        if only is not None:
            rows = rows.filter(node_id=only)
        # The master's own node first: after a restart `mirbad up` waits for it, and the
        # workers meet the connect gate in the order they start (behind 999 others it
        # took 81 s, docs/performance.md).
        return list(rows.order_by("-is_bootstrap", "node_id")[: self.max_nodes])

    async def refresh(self, only: str | None = None) -> list[str]:
        """Start workers for new nodes and restart those whose identity or address changed.

        ``only``: look at that node alone (a registry notification: reading all 1,000
        nodes for each of 1,000 approvals was quadratic). Answers the nodes it stopped
        following (each announced once, by :meth:`unfollowed`).
        """
        async with self._refreshing:
            # The workers' PendingTakeover check reads the identity on the loop each
            # second: refreshed here off the loop, it seldom waits for the database.
            await fencing.aread_identity(settings.MIRBAD.data_path)
            nodes = {n.node_id: n for n in await self.load_nodes(only)}
            dropped, stopped = [], []
            handed: dict[str, NodeWorker] = {}
            for node_id, (worker, task) in list(self.workers.items()):
                if only is not None and node_id != only:
                    continue
                if task.done() and not worker.stop.is_set():
                    # A worker never ends on its own; one that did (a bug) would leave
                    # its node Offline until the monitor restarts. Follow it again.
                    log.error("Node %s: its worker had ended; following it again", node_id)
                    del self.workers[node_id]
                    continue
                current = nodes.get(node_id)
                if current is not None and current.address == worker.node.address:
                    if current.pins == worker.node.pins:
                        continue
                    if set(worker.node.pins) <= set(current.pins):
                        # A pin was added (a rotation's pending pin): the connections
                        # already verified stay good; new ones accept either pin.
                        worker.node = current
                        worker.client.retarget(current)
                        continue
                    handed[node_id] = worker  # a pin was removed: new connections only
                worker.stop.set()
                task.cancel()
                stopped.append(task)
                del self.workers[node_id]
                if current is None:
                    dropped.append(node_id)
            for node_id, node in nodes.items():
                if node_id not in self.workers:
                    if len(self.workers) >= self.max_nodes:
                        log.error(
                            "Not following node %s: %d nodes at most", node_id, self.max_nodes
                        )
                        continue
                    worker = NodeWorker(
                        node=node,
                        stop=asyncio.Event(),
                        connect_gate=self.connect_gate,
                        fanout=self.fanout,
                        writer=self.writer,
                    )
                    if node_id in handed:
                        worker.inherit(handed[node_id])
                    self.workers[node_id] = (worker, asyncio.create_task(worker.run()))
                    log.info("Following node %s at %s", node_id, node.address)
        # A worker cancelled mid-write must not overwrite what unfollowed() says.
        await asyncio.gather(*stopped, return_exceptions=True)
        for node_id in dropped:
            await self.unfollowed(node_id)
        return dropped

    async def reconcile_due(self) -> set[str]:
        """The nodes with open operations no sender waits on reconcile them (one query for
        the fleet: one per node every 30 s was a tenth of the monitor's CPU at 300
        nodes). Answers the nodes asked."""
        self.reconciled_at = time.monotonic()
        try:
            due = await sync_to_async(operations.due_nodes)()
        except Exception:  # bookkeeping: the next pass tries again
            log.exception("Monitor: finding the operations to reconcile failed")
            return set()
        for node_id in due:
            entry = self.workers.get(node_id)
            if entry is not None:
                entry[0].reconcile_soon()
        return due

    @sync_to_async
    def load_node(self, node_id: str) -> Node | None:
        return Node.objects.filter(node_id=node_id).first()

    async def unfollowed(self, node_id: str) -> None:
        """A node the monitor does not follow (revoked, not approved, no pin): say so once."""
        node = await self.load_node(node_id)
        fixed = registry_state(approved=node.approved, revoked=node.revoked) if node else None
        status: status_cache.NodeStatus = {
            "nodeId": node_id,
            "state": (fixed or NodeState.OFFLINE).value,
            "reasons": [],
            "lastSeen": None,
        }
        # Through the workers' writer: a stopped worker's last write, still queued, must
        # not land after this one.
        await self.writer.write(status)
        await events.invalidate_status(node_id)
        await self.fanout.node_updated(node_summary(status, node), urgent=True)
        if self.fanout.fleet_watched():
            await publish_model_rows(node_id)

    async def node_changed(self, node_id: str) -> None:
        """A registry change of one node (docs/decisions.md D46): follow or drop it, announce it."""
        if node_id in await self.refresh(only=node_id):
            return
        entry = self.workers.get(node_id)
        if entry is None:
            if await self.load_node(node_id) is not None:
                await self.unfollowed(node_id)
            return
        worker, _ = entry
        fresh = await self.load_node(node_id)
        if fresh is not None:
            worker.node = fresh  # draining, maintenance, the certificate's expiry
        await worker.recompute(announce=True)

    async def _on_message(self, message: dict[str, Any]) -> None:
        if message.get("type") == WATCH_CHANGED:
            await self.fanout.refresh_watched()
            return
        if message.get("type") == "node.changed" and isinstance(message.get("nodeId"), str):
            try:
                await self.node_changed(message["nodeId"])
            except Exception:  # the next refresh catches up; the listener keeps going
                log.exception("Monitor: acting on a change of node %s failed", message["nodeId"])

    async def listen(self) -> None:
        """Act on registry changes as they are made; after a gap, refresh everything."""
        await events.listen(
            events.MONITOR_GROUP, self._on_message, ready=self.listening, lost=self._catch_up
        )

    async def _catch_up(self) -> None:
        await self.refresh()

    async def run(self) -> None:
        log.info("Monitor started")
        listener = asyncio.create_task(self.listen(), name="monitor-notifications")
        try:
            while not self.stop.is_set():
                if (
                    self.refreshed_at is None
                    or time.monotonic() - self.refreshed_at >= self.full_refresh_interval
                ):
                    self.refreshed_at = time.monotonic()
                    try:
                        await self.refresh()
                    except Exception:
                        log.exception("Monitor: refreshing the node list failed")
                if time.monotonic() - self.reconciled_at >= RECONCILE_INTERVAL:
                    await self.reconcile_due()
                try:
                    await status_cache.async_client().set(HEARTBEAT_KEY, repr(time.time()))
                except Exception:  # a Redis blip: /healthz reports the gap, the loop goes on
                    log.warning("Monitor: writing the heartbeat failed", exc_info=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=self.refresh_interval)
        finally:
            listener.cancel()
            # Bounded: a cancelled channels_redis receive() can hang in its clean-up, and
            # a stopping monitor must not wait for it.
            await asyncio.wait({listener}, timeout=5)
            for worker, task in self.workers.values():
                worker.stop.set()
                task.cancel()
            await asyncio.gather(*(t for _, t in self.workers.values()), return_exceptions=True)
            await self.fanout.close()
            log.info("Monitor stopped")
