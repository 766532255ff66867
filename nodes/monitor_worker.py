"""One node followed by the monitor (``nodes.monitor.Monitor`` keeps one per node).

On every (re)connect a :class:`NodeWorker` takes ``/info`` (protocol, identity, clock)
and a full ``/status`` snapshot, then follows ``/events``. An agent with the
``events.telemetry`` feature sends its telemetry sample in each heartbeat; an older one
is asked for ``/telemetry`` every 5 s. It reconnects with back-off (1 s doubling to
30 s). Every change is written to the Redis status cache, announced to the routers on
``router.invalidate`` when the state or the instances changed, and sent to the console
(``nodes.fanout``). Each step is a method a test can call on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from asgiref.sync import sync_to_async
from django.conf import settings

from nodes import events, fencing, hooks, operations, stalls, status_cache, telemetry
from nodes.agent_client import AgentError, AsyncAgentClient
from nodes.fanout import Direct, Fanout
from nodes.models import Node
from nodes.monitor_rows import (
    RowPublisher,
    agent_operations,
    node_summary,
    publish_model_rows,
)
from nodes.states import OFFLINE_AFTER_SECONDS, NodeState, compute_state
from nodes.status_writer import DirectWriter, Writer
from protocol.versions import PROTOCOL_VERSIONS

log = logging.getLogger("mirbad.monitor")

BACKOFF_START = 1.0
BACKOFF_MAX = 30.0
TELEMETRY_INTERVAL = 5.0
CLOCK_SKEW_LIMIT = 30.0
# What an agent lists in /info when its heartbeats carry the telemetry sample.
TELEMETRY_FEATURE = "events.telemetry"


class NodeWorker:
    """Follows one node. ``state`` is recomputed by :meth:`recompute` after every change."""

    def __init__(
        self,
        *,
        node: Node,
        stop: asyncio.Event,
        connect_gate: asyncio.Semaphore | None = None,
        fanout: Fanout | None = None,
        writer: Writer | None = None,
    ) -> None:
        """``connect_gate`` bounds how many workers (re)connect at once, ``fanout`` sends
        the console events and ``writer`` writes the record (the Monitor's; alone, a
        worker sends and writes each at once)."""
        self.node = node
        self.fanout: Fanout = fanout if fanout is not None else Direct()
        self.writer: Writer = writer if writer is not None else DirectWriter()
        self.stop = stop
        self.client = AsyncAgentClient(node=node)
        self.rows = RowPublisher(node.node_id, wanted=self.fanout.fleet_watched)
        self.connect_gate = connect_gate
        self.save_failing = False
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
        self.reconcile_task: asyncio.Task[None] | None = None
        self.settle_task: asyncio.Task[None] | None = None
        self.recent = telemetry.Recent(stalls.READBACK)  # its newest history points
        # The agent's heartbeats carry its telemetry (feature events.telemetry): no pull.
        self.telemetry_pushed = False

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
        warn = dt.timedelta(seconds=settings.MIRBAD.cert_expiring_seconds)
        if not_after is not None and not_after - dt.datetime.now(dt.UTC) < warn:
            message = f"The node certificate expires {not_after:%Y-%m-%d %H:%M} UTC"
            error = self.node.cert_renewal_error
            reasons.append(
                {
                    "code": "certificate_expiring",
                    "message": f"{message}; its renewal failed: {error}"
                    if error
                    else f"{message}.",
                }
            )
        return reasons

    def inherit(self, previous: NodeWorker) -> None:
        """Take over what ``previous`` knew of the node (the pins changed: a new worker
        dials with the new ones), so that the handover shows no Offline blip."""
        self.status = previous.status
        self.last_contact = previous.last_contact
        self.agent_reasons = previous.agent_reasons
        self.clock_skew = previous.clock_skew
        self.agent_fencing = previous.agent_fencing
        self.autostarted_boot = previous.autostarted_boot
        self.recent = previous.recent

    async def recompute(
        self,
        now: float | None = None,
        *,
        force: bool = True,
        announce: bool = False,
        models: bool = True,
    ) -> bool:
        """Recompute the state; write it, and announce it when anything visible changed.

        ``announce`` announces it whether or not it changed, once (a (re)connect took a
        fresh snapshot: the instances may have changed even when the state did not).
        """
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
        if changed or force or announce:
            await self.save()
        if changed:
            codes = ", ".join(r["code"] for r in reasons)
            log.info("Node %s: %s -> %s. %s", self.node.node_id, previous, state.value, codes)
        if changed or announce:
            await events.invalidate_status(self.node.node_id)
            await self.publish_node(urgent=True)
            if (previous != state.value or announce) and models:
                await self.publish_models()
        return changed

    async def save(self) -> None:
        """Write the record; a Redis failure is logged, never a lost agent (at 1,000
        nodes the reconnects fed the overload). The next write carries it whole."""
        try:
            await self.writer.write(self.status)
        except (redis.exceptions.RedisError, OSError) as exc:
            self._write_failed(exc)
        else:
            self.save_failing = False

    def _write_failed(self, exc: BaseException) -> None:
        if not self.save_failing:
            log.warning("Node %s: writing its status failed: %s", self.node.node_id, exc)
        self.save_failing = True

    async def publish_node(self, *, urgent: bool = False) -> None:
        """The node's console row; ``urgent``: its state changed (sent at once)."""
        await self.fanout.node_updated(node_summary(self.status, self.node), urgent=urgent)

    async def publish_models(self, model_ids: list[int] | None = None) -> None:
        """The Overview rows of this node's models (``model_ids`` only, if given), while
        a fleet page is open."""
        if not self.fanout.fleet_watched():
            return
        await publish_model_rows(self.node.node_id, model_ids)

    async def publish_download(self, download: dict[str, Any]) -> None:
        event = events.DownloadUpdated(
            type="download.updated", nodeId=self.node.node_id, download=download
        )
        await events.publish(event)

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

    async def connect(self, *, settle: bool = True) -> None:
        """``/info`` then ``/status``: protocol, identity, clock skew, the full snapshot.

        Only the two requests hold the connect gate: with the database work after them
        inside it, a restart's thousand connects queued on the database thread 32 at a
        time, and the last node was Online 82 s after the restart (docs/performance.md,
        "A fleet of a thousand machines"). The status is written and announced here;
        the database work is :meth:`settle`, awaited unless ``settle`` is false (the
        monitor's own loop runs it beside the event stream).
        """
        snapshot: dict[str, Any] | None = None
        async with self.connect_gate or contextlib.nullcontext():
            sent = time.time()
            info = await self.client.info()
            received = time.time()
            self.touch()
            common = set(info.get("protocolVersions") or []) & set(PROTOCOL_VERSIONS)
            self.incompatible = not common or info.get("nodeId") != self.node.node_id
            self.telemetry_pushed = TELEMETRY_FEATURE in (info.get("features") or [])
            if not self.incompatible:
                snapshot = await self.client.status()
        try:
            agent_time = dt.datetime.fromisoformat(str(info["time"]).replace("Z", "+00:00"))
            self.clock_skew = agent_time.timestamp() - (sent + received) / 2
        except (KeyError, ValueError):
            self.clock_skew = None
        self.status["bootId"] = str(info.get("bootId", ""))
        self.status["agentVersion"] = str(info.get("agentVersion", ""))
        self.status["protocolVersion"] = max(common) if common else None
        self.agent_fencing = info.get("fencing")
        self.status["fencing"] = self.agent_fencing
        if snapshot is None:
            await self.save_info(info, max(common) if common else None)
            self.status["lastError"] = (
                f"no common protocol version (agent {info.get('protocolVersions')}, "
                f"master {list(PROTOCOL_VERSIONS)}) or the agent reports node "
                f"{info.get('nodeId')!r}"
            )
            self.connected = True
            await self.recompute()
            return
        self.apply_snapshot(snapshot)
        self.connected = True
        self.status["lastError"] = ""
        self.backoff = BACKOFF_START
        # One announcement per (re)connect, whether or not the state changed. The status
        # is written first: the node is Online before the database is asked anything.
        await self.recompute(announce=True, models=False)
        work = self.settle(info, max(common) if common else None)
        if settle:
            await work
        else:
            self.settle_task = asyncio.create_task(work, name=f"settle-{self.node.node_id}")

    async def settle(self, info: dict[str, Any], protocol: int | None) -> None:
        """What a (re)connect leaves to the database: the models' console rows, the
        agent's facts, the open operations, the auto-starts.

        The monitor runs it beside the event stream: every database call waits its turn
        on sync_to_async's one thread, and a thousand nodes reconnecting at once queued
        there for longer than the 15 s after which a node whose events are not read is
        Offline (docs/performance.md, "A fleet of a thousand machines")."""
        await self.publish_models()
        try:
            await self.save_info(info, protocol)
        except Exception:  # bookkeeping: the next connect saves them
            log.exception("Node %s: saving its facts failed", self.node.node_id)
        await self.reconcile_operations()
        self.maybe_autostart()

    async def reconcile_operations(self) -> None:
        """Close the master's open operations on this node from the agent's records
        (nodes/operations.py): whichever master process opened them, since they are in
        the shared database. Bookkeeping: its failure never drops the connection."""
        try:
            await operations.reconcile(self.node, self.client)
        except AgentError as exc:
            log.info("Node %s: reconciling open operations failed: %s", self.node.node_id, exc)
        except Exception:
            log.exception("Node %s: reconciling open operations failed", self.node.node_id)

    def reconcile_soon(self) -> None:
        """Reconcile in a task of its own (the Monitor found open operations due here)."""
        if self.connected and (self.reconcile_task is None or self.reconcile_task.done()):
            self.reconcile_task = asyncio.create_task(self.reconcile_operations())

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
        """The agent's facts on its node's row, written only when they changed (beyond
        the disks' free space, which the telemetry carries live): after a master restart
        every node reconnects with the facts the row already holds, and a thousand
        identical writes queued beside the connects."""
        values = {
            "agent_version": str(info.get("agentVersion", ""))[:40],
            "protocol_version": protocol,
            "os": str(info.get("os", ""))[:40],
            "arch": str(info.get("arch", ""))[:40],
            "memory_total_bytes": info.get("memoryTotalBytes"),
            "facts": {
                key: info.get(key)
                for key in (
                    "hostname", "osVersion", "addresses", "cpu", "gpus", "disks", "executables",
                    "features",
                )
            },
        }  # fmt: skip
        if _steady(values) == _steady({field: getattr(self.node, field) for field in values}):
            return
        Node.objects.filter(pk=self.node.pk).update(**values)
        for field, value in values.items():
            setattr(self.node, field, value)

    def apply_snapshot(self, snapshot: dict[str, Any]) -> None:
        self.touch()
        self.agent_reasons = list((snapshot.get("health") or {}).get("reasons") or [])
        self.status["instances"] = {
            i["instanceId"]: i for i in snapshot.get("instances") or [] if "instanceId" in i
        }
        if snapshot.get("telemetry"):
            self.status["telemetry"] = snapshot["telemetry"]
        self.status["operations"] = agent_operations(snapshot)

    async def handle_event(self, name: str, data: dict[str, Any]) -> None:
        self.touch()
        if name == "instance" and "instanceId" in data:
            self.status.setdefault("instances", {})[data["instanceId"]] = data
            await self.save()
            await events.invalidate_status(self.node.node_id)
            self.rows.instance_changed(data)  # off this path: the next event is not held
        elif name == "heartbeat":
            # Memory and disk are refreshed with every heartbeat, and reach Redis with the
            # next write (the telemetry sample, every 5 s): a write per heartbeat doubled
            # the monitor's Redis writes at fleet size. What the console acts on
            # (operations, downloads) is written at once when it changed.
            sample = data.get("telemetry")
            if isinstance(sample, dict):
                self.status["telemetry"] = dict(sample)
            telemetry = self.status.setdefault("telemetry", {})
            for key in ("memory", "disks", "gpus", "weights"):
                if key in data:
                    telemetry[key] = data[key]
            if "fencing" in data and data["fencing"] != self.agent_fencing:
                self.agent_fencing = data["fencing"]
                self.status["fencing"] = self.agent_fencing
                await self.recompute()
            carried = (self.status.get("operations"), self.status.get("downloads"))
            if "operations" in data:
                self.status["operations"] = agent_operations(data)
            if "downloads" in data:
                self.status["downloads"] = {
                    d["folder"]: d
                    for d in data["downloads"]
                    if isinstance(d, dict) and "folder" in d
                }
            if isinstance(sample, dict):
                await self.take_telemetry(sample)
            elif (self.status.get("operations"), self.status.get("downloads")) != carried:
                await self.save()
        elif name == "download" and "folder" in data:
            downloads = self.status.setdefault("downloads", {})
            downloads[data["folder"]] = data
            await self.save()
            await self.publish_download(data)
        elif name == "fencing":
            self.agent_fencing = data.get("accepted")
            self.status["fencing"] = self.agent_fencing
            await self.recompute()
        elif name == "health":
            self.agent_reasons = list(data.get("reasons") or [])
            await self.recompute()
        elif name == "hello":
            # What happened between the /status snapshot and this subscription is not
            # replayed (an engine adopted or Ready in that gap would stay Starting here):
            # take the snapshot again now that nothing can be missed.
            restarted = data.get("bootId") not in (None, self.status.get("bootId"))
            before = self.status.get("instances")
            self.apply_snapshot(await self.client.status())
            if restarted:
                self.status["bootId"] = str(data.get("bootId"))
                await self.recompute(announce=True)
                self.maybe_autostart()
            elif self.status.get("instances") != before:
                await self.recompute(announce=True)

    async def follow_events(self) -> None:
        stream = self.client.events(
            read_timeout=OFFLINE_AFTER_SECONDS, telemetry=self.telemetry_pushed
        )
        async for name, data in stream:
            await self.handle_event(name, data)
            if self.stop.is_set():
                return
        raise AgentError(f"node {self.node.node_id}: the event stream ended")

    async def poll_telemetry(self) -> None:
        """Pull ``/telemetry`` every 5 s: agents without the ``events.telemetry`` feature."""
        while not self.stop.is_set():
            await asyncio.sleep(TELEMETRY_INTERVAL)
            sample = await self.client.telemetry()
            self.touch()
            self.status["telemetry"] = sample
            await self.take_telemetry(sample)

    async def take_telemetry(self, sample: dict[str, Any]) -> None:
        """A telemetry sample (``status["telemetry"]`` holds it): the record, the history
        point and the engines' stalled and slow flags (nodes/stalls.py) in one
        transaction, then the row and the point sent to the console.

        One round trip instead of four: the Redis writes of each sample were the largest
        cost left per node (docs/performance.md, "A fleet of a thousand machines")."""
        staged: list[telemetry.Point | None] = []
        try:
            await telemetry.aload(self.node.node_id, self.recent)
            await self.writer.write(
                self.status, lambda pipe: staged.append(self.stage_history(sample, pipe))
            )
        except (redis.exceptions.RedisError, OSError) as exc:
            self._write_failed(exc)
            staged = []
        else:
            self.save_failing = False
        await self.publish_node()
        if staged and staged[0] is not None:
            await self.fanout.node_telemetry(self.node.node_id, staged[0])

    def stage_history(
        self, sample: dict[str, Any], pipe: aioredis.client.Pipeline
    ) -> telemetry.Point | None:
        """Queue the sample's history point and the stall flags; a failure here (an
        agent's odd sample) is logged and never keeps the record from being written."""
        try:
            point = telemetry.stage(self.node.node_id, sample, time.time(), self.recent, pipe)
            stalls.stage(self.node.node_id, self.recent.points, point["t"], pipe)
        except Exception:  # the history must not drop the node's connection or its record
            log.exception("Node %s: recording its telemetry failed", self.node.node_id)
            return None
        return point

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
                    await self.connect(settle=False)
                    if self.incompatible:
                        await self._sleep(BACKOFF_MAX)
                        continue
                    if self.telemetry_pushed:
                        await self._race(self.follow_events())
                    else:
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
            for task in (self.autostart_task, self.reconcile_task, self.settle_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self.rows.close()
            await self.client.aclose()

    async def _lost(self, error: str) -> None:
        if self.connected:
            log.warning("Node %s: connection lost: %s", self.node.node_id, error)
        self.connected = False
        self.status["lastError"] = error
        try:
            await self.recompute()
        except Exception:  # Redis away or its pool exhausted: keep trying the node
            log.exception("Node %s: recording the lost connection failed", self.node.node_id)
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
                    raise task.exception()  # type: ignore[misc]  # not None: checked above
        finally:
            for task in [*tasks, stopper]:
                task.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)


def _steady(values: dict[str, Any]) -> dict[str, Any]:
    """A node's facts without what moves between two connects of the same agent: the
    disks' free space."""
    facts = dict(values.get("facts") or {})
    disks = facts.get("disks")
    if isinstance(disks, list):
        facts["disks"] = [
            {k: v for k, v in d.items() if k not in ("freeBytes", "percent")}
            if isinstance(d, dict)
            else d
            for d in disks
        ]
    return {**values, "facts": facts}
