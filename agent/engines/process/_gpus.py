"""One start at a time per GPU, and what a running engine really uses.

Mixed into ``ProcessRuntime`` (agent.engines.process._runtime), whose state it uses. A start
waits for its GPUs' locks (docs/agent-api.md, "One start per GPU"), a restart
whose GPUs another start holds is queued as Starting, and a Ready engine is
measured: the GPU memory delta of its pinned GPUs, or its process group's RSS,
re-measured while it runs (docs/agent-api.md, "measured").
"""

from __future__ import annotations

import asyncio
import logging
import time

from agent._errors import SpecRejected
from agent.engines._measure import RSS, GpuLocks, Measured, gpu_delta
from agent.engines.process._handle import AdoptedProcess, EngineProcess, PortAllocator
from agent.engines.process._instance import READY, STARTING, Instance
from agent.telemetry import GpuSampler, group_rss, memory_used_by_uuid

__all__ = ["GpuStarts"]

log = logging.getLogger("mirbad.agent.process")


class GpuStarts:
    """GPU start queueing and memory measurement of ProcessRuntime (state declared here)."""

    gpus: GpuSampler
    _gpu_locks: GpuLocks
    _ports: PortAllocator
    _measure_refresh: float

    def _fail(self, inst: Instance, error: str, exit_code: int | None) -> None:
        raise NotImplementedError

    async def _spawn(self, inst: Instance, *, recorded: bool = False) -> bool:
        raise NotImplementedError

    def _changed(self, inst: Instance) -> None:
        raise NotImplementedError

    def _persist_quietly(self) -> None:
        raise NotImplementedError

    async def check_gpus_present(self, uuids: tuple[str, ...]) -> None:
        """Refuse (422) a GPU UUID this node's probe does not list."""
        gpus, error = await self.gpus.current()
        known = [g["uuid"] for g in gpus if isinstance(g.get("uuid"), str)]
        unknown = [u for u in uuids if u not in known]
        if not unknown:
            return
        if known:
            have = "it has " + ", ".join(known)
        elif self.gpus.absent:
            have = "it has none: nvidia-smi is not installed"
        else:
            have = f"it has none: {error or 'no NVIDIA GPU found (NVML, nvidia-smi)'}"
        raise SpecRejected(
            f"gpuUuids: {unknown[0]} is not a GPU of this node ({have})",
            details={"field": "gpuUuids", "unknown": unknown, "nodeGpus": known},
        )

    def _release_gpus(self, inst: Instance) -> None:
        """Let the next start on this instance's GPUs go (idempotent)."""
        held, inst.gpu_held = inst.gpu_held, []
        self._gpu_locks.release(held)

    async def _start_queued(self, inst: Instance) -> bool:
        """Wait for the instance's GPUs, then start it; False when it ended without starting.

        Waits outside the instance lock, so a stop is never held up by the queue.
        """
        held = await self._gpu_locks.take(inst.spec.gpu_uuids)
        try:
            async with inst.lock:
                if inst.stopping:
                    return False
                inst.gpu_held, held = held, []
                queued_at, inst.start_queued_at = inst.start_queued_at, None
                log.info(
                    "Instance %s got its GPU(s) after %.1f s in the queue",
                    inst.instance_id,
                    time.time() - (queued_at or time.time()),
                )
                if inst.port is None:
                    try:
                        inst.port = await self._ports.reserve()
                    except SpecRejected as exc:
                        self._fail(inst, f"llama-server was not started: {exc.message}", None)
                        return False
                return await self._spawn(inst)
        finally:
            self._gpu_locks.release(held)

    def _queue_restart(self, inst: Instance) -> None:
        """A restart after Ready whose GPUs another start holds: Starting, no process yet."""
        inst.state = STARTING
        inst.pid = None
        inst.proc = None
        inst.ready_at = None
        inst.measured = None
        inst.start_queued_at = time.time()
        log.info(
            "Restart of %s waits for GPU(s) %s: another start holds them",
            inst.instance_id,
            ", ".join(inst.spec.gpu_uuids),
        )
        self._changed(inst)

    async def _gpu_used(self, inst: Instance) -> dict[str, int] | None:
        """memory.used of the instance's GPUs now; None (logged) when the probe cannot say."""
        gpus, error = await self.gpus.sample()
        used = memory_used_by_uuid(gpus)
        missing = [u for u in inst.spec.gpu_uuids if u not in used]
        if missing:
            log.warning(
                "Instance %s: no memory.used for GPU %s (%s); its memory is not measured",
                inst.instance_id,
                missing[0],
                error or "the probe does not list it",
            )
            return None
        return {u: used[u] for u in inst.spec.gpu_uuids}

    async def _measure(self, inst: Instance) -> Measured | None:
        """What the engine uses right after Ready; None when it cannot be (or was) measured.

        A GPU start keeps a measurement it already has (an adopted engine's: its
        "before" sample is gone); one without a "before" sample is not measured.
        """
        if inst.spec.gpu_uuids:
            baseline = inst.gpu_baseline
            if inst.measured is not None or baseline is None:
                return None
            if any(u not in baseline for u in inst.spec.gpu_uuids):
                return None
            after = await self._gpu_used(inst)
            if after is None:
                return None
            return gpu_delta(inst.spec.gpu_uuids, baseline, after)
        if inst.pid is None:
            return None
        total, count = await asyncio.to_thread(group_rss, inst.pid)
        if count == 0:
            return None
        previous = inst.measured.peak_bytes if inst.measured and inst.measured.kind == RSS else 0
        return Measured(kind=RSS, bytes=total, at=time.time(), peak_bytes=max(total, previous))

    async def _refresh_rss(self, inst: Instance) -> None:
        """Re-measure a Ready engine's group RSS and keep the peak (persisted, no event)."""
        pid = inst.pid
        if pid is None or inst.state != READY:
            return
        total, count = await asyncio.to_thread(group_rss, pid)
        if count == 0 or inst.pid != pid or inst.state != READY:
            return  # it exited meanwhile; the supervisor sees that
        previous = inst.measured.peak_bytes if inst.measured else 0
        inst.measured = Measured(
            kind=RSS, bytes=total, at=time.time(), peak_bytes=max(total, previous)
        )
        # No instance event: events mark state changes. /instances and /status show it.
        self._persist_quietly()

    async def _wait_exit(self, inst: Instance, proc: EngineProcess | AdoptedProcess) -> int | None:
        """Wait for a Ready engine to exit, re-measuring its RSS every measure period."""
        if inst.spec.gpu_uuids:
            return await proc.wait()
        waiter = asyncio.ensure_future(proc.wait())
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=self._measure_refresh)
                if done:
                    return waiter.result()
                await self._refresh_rss(inst)
        finally:
            if not waiter.done():
                waiter.cancel()
