"""The monitor: one connection per approved node, feeding the status cache.

For each node it takes ``/info`` (protocol, identity, clock) and a full
``/status`` snapshot on every (re)connect, follows ``/events``, pulls
``/telemetry`` every few seconds, and reconnects with back-off (1 s doubling
to 30 s). Every change is written to the Redis status cache and published to
the Channels groups the console listens on. Each step is a method a test can
call on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from nodes import events, fencing, hooks, status_cache
from nodes.agent_client import AgentError, AsyncAgentClient
from nodes.models import Node
from nodes.states import OFFLINE_AFTER_SECONDS, SERVING, NodeState, compute_state
from protocol.versions import PROTOCOL_VERSIONS

log = logging.getLogger("mirbad.monitor")

BACKOFF_START = 1.0
BACKOFF_MAX = 30.0
TELEMETRY_INTERVAL = 5.0
CLOCK_SKEW_LIMIT = 30.0
# The active monitor writes the time into this key at every step of its loop (every
# refresh_interval, 5 s); /healthz calls it stale after three missed steps.
HEARTBEAT_KEY = "mirbad:monitor:heartbeat"
HEARTBEAT_STALE_AFTER = 15.0


def heartbeat_age(now: float | None = None) -> float | None:
    """Seconds since the active monitor's last step, or None if it never wrote one."""
    raw = status_cache.read_client().get(HEARTBEAT_KEY)  # a stalled Redis: error, no hang
    if raw is None:
        return None
    return (time.time() if now is None else now) - float(raw)


def node_summary(status: status_cache.NodeStatus) -> events.NodeSummary:
    telemetry = status.get("telemetry") or {}
    memory = telemetry.get("memory") or {}
    return events.NodeSummary(
        nodeId=status["nodeId"],
        state=status.get("state", NodeState.OFFLINE.value),
        reasons=[r.get("code", "") for r in status.get("reasons", [])],
        cpuPercent=telemetry.get("cpuPercent"),
        memoryPercent=memory.get("percent"),
        memoryUsedBytes=memory.get("usedBytes"),
        memoryTotalBytes=memory.get("totalBytes"),
        lastSeen=status.get("lastSeen"),
    )


class NodeWorker:
    """Follows one node. ``state`` is recomputed by :meth:`recompute` after every change."""

    def __init__(self, *, node: Node, stop: asyncio.Event) -> None:
        self.node = node
        self.stop = stop
        self.client = AsyncAgentClient(node=node)
        self.connected = False
        self.incompatible = False
        self.agent_fencing: dict[str, Any] | None = None
        self.last_contact: float | None = None
        self.agent_reasons: list[dict[str, str]] = []
        self.clock_skew: float | None = None
        self.status: status_cache.NodeStatus = {
            "nodeId": node.node_id,
            "state": NodeState.OFFLINE.value,
            "reasons": [],
            "lastSeen": None,
            "lastError": "",
            "instances": {},
            "telemetry": {},
        }
        self.backoff = BACKOFF_START
        self.autostarted_boot: str | None = None
        self.autostart_task: asyncio.Task[None] | None = None

    # -- state -------------------------------------------------------------------------

    def reasons(self) -> list[dict[str, str]]:
        reasons = list(self.agent_reasons)
        if self.clock_skew is not None and abs(self.clock_skew) > CLOCK_SKEW_LIMIT:
            reasons.append(
                {
                    "code": "clock_skew",
                    "message": f"The agent's clock is {self.clock_skew:+.0f} s off the master's.",
                }
            )
        not_after = self.node.cert_not_after
        if not_after is not None and not_after - dt.datetime.now(dt.UTC) < dt.timedelta(days=14):
            reasons.append(
                {
                    "code": "certificate_expiring",
                    "message": f"The node certificate expires {not_after:%Y-%m-%d %H:%M} UTC.",
                }
            )
        return reasons

    async def recompute(self, now: float | None = None, *, force: bool = True) -> bool:
        """Recompute the state; write and publish when anything visible changed."""
        moment = time.time() if now is None else now
        since = None if self.last_contact is None else moment - self.last_contact
        reasons = self.reasons()
        state = compute_state(
            approved=self.node.approved,
            revoked=self.node.revoked,
            enrolled=self.node.enrolled,
            connected=self.connected or (since is not None and since <= OFFLINE_AFTER_SECONDS),
            seconds_since_contact=since,
            incompatible=self.incompatible,
            pending_takeover=self.pending_takeover(),
            reasons=reasons,
        )
        previous = self.status.get("state")
        changed = previous != state.value or self.status.get("reasons") != reasons
        self.status["state"] = state.value
        self.status["reasons"] = reasons
        self.status["lastSeen"] = self.last_contact
        self.status["clockSkewSeconds"] = self.clock_skew
        if changed or force:
            await status_cache.awrite(self.status)
        if changed:
            codes = ", ".join(r["code"] for r in reasons)
            log.info("Node %s: %s -> %s. %s", self.node.node_id, previous, state.value, codes)
            await self.publish_node()
            if previous != state.value:
                await self.publish_models()
        return changed

    async def publish_node(self) -> None:
        event = events.NodeUpdated(type="node.updated", node=node_summary(self.status))
        await events.publish([events.FLEET_GROUP, events.node_group(self.node.node_id)], event)

    async def publish_models(self) -> None:
        for instance in (self.status.get("instances") or {}).values():
            await self.publish_instance(instance)

    async def publish_instance(self, instance: dict[str, Any]) -> None:
        model_id = instance.get("modelId")
        if not isinstance(model_id, int):
            return
        serving = self.status.get("state") in SERVING
        event = events.ModelUpdated(
            type="model.updated",
            model=events.ModelSummary(
                modelId=model_id,
                servedName=str(instance.get("servedName", "")),
                state=str(instance.get("state")) if serving else "Offline",
                nodeId=self.node.node_id,
                error=instance.get("error"),
                restartCount=int(instance.get("restartCount") or 0),
                measuredBytes=(instance.get("measured") or {}).get("bytes"),
            ),
        )
        await events.publish([events.FLEET_GROUP, events.model_group(model_id)], event)

    async def publish_download(self, download: dict[str, Any]) -> None:
        event = events.DownloadUpdated(
            type="download.updated", nodeId=self.node.node_id, download=download
        )
        await events.publish([events.FLEET_GROUP, events.node_group(self.node.node_id)], event)

    async def record_measurement(self, instance: dict[str, Any]) -> None:
        """Keep the instance's measured memory beside its budget (one row per start)."""
        try:
            await sync_to_async(hooks.record_measurement)(self.node.node_id, instance)
        except Exception:  # a bookkeeping failure must not drop the node's connection
            log.exception("Node %s: recording a memory measurement failed", self.node.node_id)

    async def autostart(self) -> None:
        """Start the auto-start models this agent lost; one at a time on this node.

        Run as its own task after a connect that saw a new boot id, so the event
        stream keeps being read while the starts (each waits on the agent) go on.
        """
        try:
            outcomes = await sync_to_async(hooks.autostart, thread_sensitive=False)(
                self.node.node_id
            )
        except Exception:
            log.exception("Node %s: auto-start failed", self.node.node_id)
            return
        for outcome in outcomes:
            if not outcome["started"]:
                log.warning(
                    "Node %s: auto-start left %s stopped: %s",
                    self.node.node_id,
                    outcome["model"],
                    outcome["reason"],
                )

    def pending_takeover(self) -> bool:
        """The agent accepted a master this one cannot overrule (docs/agent-api.md, "Fencing")."""
        try:
            identity = fencing.read_identity(settings.MIRBAD.data_path)
        except fencing.FencingError:
            return True
        return fencing.outranks(self.agent_fencing, identity)

    def touch(self) -> None:
        self.last_contact = time.time()

    # -- steps -------------------------------------------------------------------------

    async def connect(self) -> None:
        """``/info`` then ``/status``: protocol, identity, clock skew, the full snapshot."""
        sent = time.time()
        info = await self.client.info()
        received = time.time()
        self.touch()
        common = set(info.get("protocolVersions") or []) & set(PROTOCOL_VERSIONS)
        self.incompatible = not common or info.get("nodeId") != self.node.node_id
        try:
            agent_time = dt.datetime.fromisoformat(str(info["time"]).replace("Z", "+00:00"))
            self.clock_skew = agent_time.timestamp() - (sent + received) / 2
        except (KeyError, ValueError):
            self.clock_skew = None
        self.status["bootId"] = str(info.get("bootId", ""))
        self.status["agentVersion"] = str(info.get("agentVersion", ""))
        self.status["protocolVersion"] = max(common) if common else None
        self.agent_fencing = info.get("fencing")
        self.status["fencing"] = self.agent_fencing  # type: ignore[typeddict-unknown-key]
        await self.save_info(info, max(common) if common else None)
        if self.incompatible:
            self.status["lastError"] = (
                f"no common protocol version (agent {info.get('protocolVersions')}, "
                f"master {list(PROTOCOL_VERSIONS)}) or the agent reports node "
                f"{info.get('nodeId')!r}"
            )
            self.connected = True
            await self.recompute()
            return
        snapshot = await self.client.status()
        self.apply_snapshot(snapshot)
        self.connected = True
        self.status["lastError"] = ""
        self.backoff = BACKOFF_START
        await self.recompute()
        await self.publish_node()
        await self.publish_models()
        self.maybe_autostart()

    def maybe_autostart(self) -> None:
        """One auto-start pass per agent boot id (a reboot or an agent restart)."""
        boot = self.status.get("bootId")
        if not boot or boot == self.autostarted_boot or self.pending_takeover():
            return
        self.autostarted_boot = boot
        if self.autostart_task is None or self.autostart_task.done():
            self.autostart_task = asyncio.create_task(self.autostart())

    @sync_to_async
    def save_info(self, info: dict[str, Any], protocol: int | None) -> None:
        Node.objects.filter(pk=self.node.pk).update(
            agent_version=str(info.get("agentVersion", ""))[:40],
            protocol_version=protocol,
            os=str(info.get("os", ""))[:40],
            arch=str(info.get("arch", ""))[:40],
            memory_total_bytes=info.get("memoryTotalBytes"),
            facts={
                key: info.get(key)
                for key in (
                    "hostname", "osVersion", "addresses", "cpu", "gpus", "disks", "executables",
                    "features",
                )
            },
        )  # fmt: skip

    def apply_snapshot(self, snapshot: dict[str, Any]) -> None:
        self.touch()
        self.agent_reasons = list((snapshot.get("health") or {}).get("reasons") or [])
        self.status["instances"] = {
            i["instanceId"]: i for i in snapshot.get("instances") or [] if "instanceId" in i
        }
        if snapshot.get("telemetry"):
            self.status["telemetry"] = snapshot["telemetry"]

    async def handle_event(self, name: str, data: dict[str, Any]) -> None:
        self.touch()
        if name == "instance" and "instanceId" in data:
            self.status.setdefault("instances", {})[data["instanceId"]] = data
            await status_cache.awrite(self.status)
            await self.publish_instance(data)
            if data.get("measured"):
                await self.record_measurement(data)
        elif name == "heartbeat":
            # Memory and disk are refreshed with every heartbeat, not only at connect.
            telemetry = self.status.setdefault("telemetry", {})
            for key in ("memory", "disks", "gpus", "weights"):
                if key in data:
                    telemetry[key] = data[key]
            if "fencing" in data and data["fencing"] != self.agent_fencing:
                self.agent_fencing = data["fencing"]
                self.status["fencing"] = self.agent_fencing  # type: ignore[typeddict-unknown-key]
                await self.recompute()
            if "downloads" in data:
                self.status["downloads"] = {  # type: ignore[typeddict-unknown-key]
                    d["folder"]: d
                    for d in data["downloads"]
                    if isinstance(d, dict) and "folder" in d
                }
            await status_cache.awrite(self.status)
        elif name == "download" and "folder" in data:
            downloads = self.status.setdefault("downloads", {})  # type: ignore[typeddict-item]
            downloads[data["folder"]] = data
            await status_cache.awrite(self.status)
            await self.publish_download(data)
        elif name == "fencing":
            self.agent_fencing = data.get("accepted")
            self.status["fencing"] = self.agent_fencing  # type: ignore[typeddict-unknown-key]
            await self.recompute()
        elif name == "health":
            self.agent_reasons = list(data.get("reasons") or [])
            await self.recompute()
        elif name == "hello" and data.get("bootId") not in (None, self.status.get("bootId")):
            # The agent restarted between /status and /events: take a fresh snapshot.
            self.apply_snapshot(await self.client.status())
            self.status["bootId"] = str(data.get("bootId"))
            await self.recompute()
            await self.publish_models()
            self.maybe_autostart()

    async def follow_events(self) -> None:
        async for name, data in self.client.events(read_timeout=OFFLINE_AFTER_SECONDS):
            await self.handle_event(name, data)
            if self.stop.is_set():
                return
        raise AgentError(f"node {self.node.node_id}: the event stream ended")

    async def poll_telemetry(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(TELEMETRY_INTERVAL)
            sample = await self.client.telemetry()
            self.touch()
            self.status["telemetry"] = sample
            await status_cache.awrite(self.status)
            await self.publish_node()

    async def watchdog(self) -> None:
        """Turn a silent node Offline after 15 s, even while a connect attempt hangs."""
        while not self.stop.is_set():
            await asyncio.sleep(1.0)
            await self.recompute(force=False)

    async def run(self) -> None:
        watchdog = asyncio.create_task(self.watchdog())
        try:
            while not self.stop.is_set():
                try:
                    await self.connect()
                    if self.incompatible:
                        await self._sleep(BACKOFF_MAX)
                        continue
                    await self._race(self.follow_events(), self.poll_telemetry())
                except AgentError as exc:
                    await self._lost(str(exc))
                except Exception as exc:  # keep following the node whatever went wrong
                    log.exception("Node %s: unexpected monitor error", self.node.node_id)
                    await self._lost(f"{type(exc).__name__}: {exc}")
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            if self.autostart_task is not None:
                self.autostart_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.autostart_task
            await self.client.aclose()

    async def _lost(self, error: str) -> None:
        if self.connected:
            log.warning("Node %s: connection lost: %s", self.node.node_id, error)
        self.connected = False
        self.status["lastError"] = error
        await self.recompute()
        await self._sleep(self.backoff)
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)

    async def _race(self, *coros: Any) -> None:
        tasks = [asyncio.create_task(c) for c in coros]
        stopper = asyncio.create_task(self.stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in [*tasks, stopper]:
                task.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)


class Monitor:
    """Keeps one :class:`NodeWorker` per approved, enrolled node."""

    def __init__(self, *, refresh_interval: float = 5.0, max_nodes: int = 1000) -> None:
        self.refresh_interval = refresh_interval
        self.max_nodes = max_nodes
        self.stop = asyncio.Event()
        self.workers: dict[str, tuple[NodeWorker, asyncio.Task[None]]] = {}

    @sync_to_async
    def load_nodes(self) -> list[Node]:
        return list(
            Node.objects.filter(approved=True, revoked=False)
            .exclude(spki_pin="", pending_pin="")
            .order_by("node_id")[: self.max_nodes]
        )

    async def refresh(self) -> None:
        """Start workers for new nodes and restart those whose identity or address changed."""
        nodes = {n.node_id: n for n in await self.load_nodes()}
        for node_id, (worker, task) in list(self.workers.items()):
            current = nodes.get(node_id)
            if (
                current is None
                or current.pins != worker.node.pins
                or current.address != worker.node.address
            ):
                worker.stop.set()
                task.cancel()
                del self.workers[node_id]
                if current is None:
                    await status_cache.awrite(
                        {"nodeId": node_id, "state": NodeState.OFFLINE.value, "lastSeen": None}
                    )
        for node_id, node in nodes.items():
            if node_id not in self.workers:
                worker = NodeWorker(node=node, stop=asyncio.Event())
                self.workers[node_id] = (worker, asyncio.create_task(worker.run()))
                log.info("Following node %s at %s", node_id, node.address)

    async def run(self) -> None:
        log.info("Monitor started")
        try:
            while not self.stop.is_set():
                try:
                    await self.refresh()
                except Exception:
                    log.exception("Monitor: refreshing the node list failed")
                try:
                    await status_cache.async_client().set(HEARTBEAT_KEY, repr(time.time()))
                except Exception:  # a Redis blip: /healthz reports the gap, the loop goes on
                    log.warning("Monitor: writing the heartbeat failed", exc_info=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=self.refresh_interval)
        finally:
            for worker, task in self.workers.values():
                worker.stop.set()
                task.cancel()
            await asyncio.gather(*(t for _, t in self.workers.values()), return_exceptions=True)
            log.info("Monitor stopped")
