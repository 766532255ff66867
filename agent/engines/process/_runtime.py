"""The process runtime: starts, supervises and stops llama-server processes.

Per instance: validate the spec, pick a loopback port under a lock, generate a 256-bit
API key (passed as LLAMA_API_KEY, never in argv), start the engine in its own process
group with its output appended to ``{StateDirectory}/logs/ss-{instanceId}.log``, and
poll until it is Ready (``/health`` is 200 and ``/v1/models`` with the key lists the
alias; the second check catches a foreign process that took the port). An exit before
Ready is Failed with the exit code and the log tail; an exit after Ready is restarted on
the same port within RestartBudget per RestartWindowSeconds. Every state change is
persisted to ``processes.json`` (0600, it holds the keys) and published as an
``instance`` event.

Each start is recorded twice: a *pending start* (spec, port, key, argv digest, the time
it was written, no pid) is written atomically before the process exists, and replaced
by the full record (pid, creation time, program) once it does. A crash between the two
leaves a pending record, from which the next agent recognises the orphan.

On start, the runtime reconciles with the records of the previous run (see
:mod:`agent.engines.process._reconcile` for how a process is identified): an engine that is provably
the one recorded is *adopted* (same pid, port and key; Starting until the Ready probe
passes again, then supervised as usual, its exit seen through a pidfd or by polling);
a record whose process is gone or whose pid now belongs to another process reads
Stopped (nothing is killed); an orphan of a pending start, or an unidentified process
of our runtimes folders holding one of our ports with that port in its arguments, is
stopped; any other process is left alone.

GPUs. A spec may pin GPUs by UUID (``gpuUuids``); the agent checks they exist on this
node and sets CUDA_VISIBLE_DEVICES to them, in the spec's order. Only one start per GPU
runs at a time (docs/agent-api.md, "One start per GPU"): a start takes its GPUs' locks, in
sorted order, and holds them until the instance is Ready, Failed or stopped; a start
whose GPUs are busy is answered at once, Starting with ``startQueuedAt`` and no port
or pid, and goes on when they are free. Starts without GPUs never wait.

Measured memory (docs/agent-api.md, "measured"). Right after Ready the agent measures what the
engine really uses: for a GPU start the rise of nvidia-smi's memory.used on its GPUs
between just before the process was created and just after Ready (the per-GPU lock is
what keeps another start's allocation out of it); for a start without GPUs the RSS of
the engine's whole process group, refreshed at most once a minute while Ready with the
peak kept. The measurement is persisted with the record, so an adopted engine keeps it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import time
from typing import Any

import aiohttp
import psutil

from agent._config import AgentConfig
from agent._errors import Conflict, ModelNotRunning, NotFound, StateUnavailable
from agent.engines._executables import Catalogue
from agent.engines._measure import GpuLocks, Measured
from agent.engines._ready import engine_ready
from agent.engines._spec import (
    check_args,
    check_env,
    check_runtime,
    parse_launch_spec,
    resolve_model_path,
    substitute,
)
from agent.engines.process._adoption import Adoption
from agent.engines.process._gpus import GpuStarts
from agent.engines.process._handle import (
    AdoptedProcess,
    EngineProcess,
    PortAllocator,
    exit_text,
    open_log,
    read_log_tail,
)
from agent.engines.process._instance import (
    FAILED,
    GONE_ERROR,
    PENDING_STOPPED_ERROR,
    READY,
    STARTING,
    STOPPED,
    Instance,
)
from agent.engines.process._reconcile import (
    argv_digest,
)
from agent.engines.process._records import PROCESSES_FILE, write_records
from agent.state import EventBus
from agent.telemetry import GpuProbe, GpuSampler

__all__ = ["GONE_ERROR", "PENDING_STOPPED_ERROR", "Instance", "Measured", "ProcessRuntime"]

log = logging.getLogger("mirbad.agent.process")

_BASE_ENV = ("PATH", "HOME", "LANG")
# What this runtime runs: (runtime, delivery).
PROCESS_OFFERS = (("llamacpp", "process"),)


class ProcessRuntime(GpuStarts, Adoption):
    """All instances of this agent, and the supervisor task of each."""

    def __init__(
        self,
        *,
        config: AgentConfig,
        catalogue: Catalogue,
        bus: EventBus,
        ready_poll_interval: float = 0.5,
        stop_grace_seconds: float = 10.0,
        gpu_probe: GpuProbe | None = None,
        measure_refresh_seconds: float = 60.0,
    ) -> None:
        """``gpu_probe`` replaces nvidia-smi (tests pretend to have GPUs with it);
        ``measure_refresh_seconds`` is how often a Ready instance's RSS is re-measured.
        """
        self._config = config
        self._catalogue = catalogue
        self._bus = bus
        self._poll = ready_poll_interval
        self._grace = stop_grace_seconds
        self._ports = PortAllocator(start=config.port_range_start, end=config.port_range_end)
        self._instances: dict[str, Instance] = {}
        self._launch_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._state_file = config.state_directory / PROCESSES_FILE
        self._log_dir = config.state_directory / "logs"
        self.gpus = GpuSampler(gpu_probe)
        self._gpu_locks = GpuLocks()
        self._measure_refresh = measure_refresh_seconds

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the probe session, adopt the previous run's engines and stop its orphans."""
        self._log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.gpus.cached()  # a first GPU probe in the background, for heartbeats and launches
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=5), connector=aiohttp.TCPConnector(force_close=True)
        )
        await self._reconcile()

    async def close(self, *, stop_instances: bool = True) -> None:
        """Stop every engine, or leave them running and only stop watching them.

        Left running (StopInstancesOnShutdown false), their records stay in
        processes.json with pid and key; the next agent start finds them there.
        """
        if stop_instances:
            running = [i for i in self._instances.values() if i.state in (STARTING, READY)]
            await asyncio.gather(
                *(self.stop(i.instance_id) for i in running), return_exceptions=True
            )
        else:
            for inst in self._instances.values():
                async with inst.lock:
                    if inst.task is not None:
                        inst.task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await inst.task
                        inst.task = None
                    if inst.proc is not None:
                        # The record keeps the pid; this runtime no longer manages it.
                        inst.proc.detach()
                        inst.proc = None
                        log.info("Leaving %s running (pid %s)", inst.instance_id, inst.pid)
            self._persist_quietly()
        await self.gpus.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- queries ---------------------------------------------------------------------

    def list(self) -> list[dict[str, Any]]:
        return [i.to_json() for i in self._instances.values()]

    def get(self, instance_id: str) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise NotFound(f"instance {instance_id!r} does not exist on this node") from None

    # -- persistence and events ------------------------------------------------------

    def _persist(self) -> None:
        write_records(self._state_file, (i.to_record() for i in self._instances.values()))

    def _persist_quietly(self) -> None:
        try:
            self._persist()
        except StateUnavailable as exc:
            log.error("%s", exc.message)

    def _changed(self, inst: Instance) -> None:
        self._persist_quietly()
        self._bus.publish("instance", inst.to_json())

    # -- launch ----------------------------------------------------------------------

    async def launch(self, body: Any) -> dict[str, Any]:
        """Validate and start an instance; idempotent for an identical running spec.

        A start whose GPUs another start holds is answered at once (Starting, with
        ``startQueuedAt``); its supervisor starts the engine when the GPUs are free.
        """
        spec = parse_launch_spec(body)
        check_runtime(spec, PROCESS_OFFERS)
        alias = check_args(spec.args, spec.executable_version)
        check_env(spec.env, spec.executable_version, self._config.engine_env_allow)
        model_path = resolve_model_path(
            self._config.models_root_path, spec.model_folder, spec.model_file
        )
        if spec.gpu_uuids:
            await self.check_gpus_present(spec.gpu_uuids)
        exe = self._catalogue.resolve(spec.executable_name, spec.executable_version)
        if exe.version != spec.executable_version:
            # The node's default was chosen: check against that version's allow-list too.
            check_args(spec.args, exe.version)
            check_env(spec.env, exe.version, self._config.engine_env_allow)
        async with self._launch_lock:
            current = self._instances.get(spec.instance_id)
            if current is not None and current.state in (STARTING, READY):
                if current.spec == spec:
                    return current.to_json()
                raise Conflict(
                    f"instance {spec.instance_id!r} is {current.state} with another spec; stop it first"
                )
            if current is not None and current.task is not None:
                await current.task
            inst = Instance(spec=spec, executable=exe, alias=alias, model_path=model_path)
            if spec.gpu_uuids and not self._gpu_locks.free(spec.gpu_uuids):
                return self._queue_launch(inst, current)
            if spec.gpu_uuids:
                # Free was checked just above with nothing awaited since: this cannot wait.
                inst.gpu_held = await self._gpu_locks.take(spec.gpu_uuids)
            try:
                inst.port = await self._ports.reserve()
            except BaseException:
                self._release_gpus(inst)
                raise
            self._instances[spec.instance_id] = inst
            self._mark_pending(inst)
            try:
                self._persist()
            except StateUnavailable:
                self._ports.release(inst.port)
                self._release_gpus(inst)
                if current is not None:
                    self._instances[spec.instance_id] = current
                else:
                    del self._instances[spec.instance_id]
                raise
            async with inst.lock:
                started = await self._spawn(inst, recorded=True)
            if started:
                inst.task = asyncio.create_task(
                    self._supervise(inst), name=f"supervise-{inst.instance_id}"
                )
            return inst.to_json()

    def _queue_launch(self, inst: Instance, current: Instance | None) -> dict[str, Any]:
        """Record a start that waits for its GPUs, and hand it to its supervisor."""
        inst.start_queued_at = time.time()
        self._instances[inst.instance_id] = inst
        try:
            self._persist()
        except StateUnavailable:
            if current is not None:
                self._instances[inst.instance_id] = current
            else:
                del self._instances[inst.instance_id]
            raise
        log.info(
            "Start of %s waits for GPU(s) %s: another start holds them",
            inst.instance_id,
            ", ".join(inst.spec.gpu_uuids),
        )
        inst.task = asyncio.create_task(
            self._supervise(inst, queued=True), name=f"supervise-{inst.instance_id}"
        )
        self._bus.publish("instance", inst.to_json())
        return inst.to_json()

    # builtins.list: inside this class, plain ``list`` names the method above.
    def _argv(self, inst: Instance) -> builtins.list[str]:
        assert inst.port is not None
        return [
            str(inst.executable.path),
            *substitute(inst.spec.args, model_path=inst.model_path, port=inst.port),
        ]

    def _mark_pending(self, inst: Instance) -> None:
        """Turn the instance's record into a pending start (the next persist writes it)."""
        inst.pid = None
        inst.pid_create_time = None
        inst.pid_cmdline = []
        inst.pid_exe = None
        inst.adopted = False
        inst.argv_digest = argv_digest(self._argv(inst))
        inst.pending_since = time.time()

    async def _spawn(self, inst: Instance, *, recorded: bool = False) -> bool:
        """Start the engine process; False (and the instance Failed) if it cannot start.

        The pending-start record is written first (``recorded``: the caller did).
        """
        argv = self._argv(inst)
        if not recorded:
            self._mark_pending(inst)
            try:
                self._persist()
            except StateUnavailable as exc:
                inst.pending_since = None
                self._fail(inst, f"llama-server was not started: {exc.message}", None)
                return False
        env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
        env.update(inst.spec.env_dict)
        env["LLAMA_API_KEY"] = inst.key
        if inst.spec.gpu_uuids:
            # In the spec's order: CUDA numbers the visible devices in it (CUDA0, ...).
            env["CUDA_VISIBLE_DEVICES"] = ",".join(inst.spec.gpu_uuids)
        log_path = self._log_dir / f"ss-{inst.instance_id}.log"
        inst.state = STARTING
        inst.ready_at = None
        inst.exit_code = None
        inst.error = None
        inst.log_tail = []
        inst.start_queued_at = None
        inst.measured = None
        # The "before" of the GPU delta, as late as possible before the process exists;
        # this start holds its GPUs' locks, so no other start of ours lands in it.
        inst.gpu_baseline = await self._gpu_used(inst) if inst.spec.gpu_uuids else None
        try:
            log_file, inst.log_offset = await asyncio.to_thread(
                open_log, log_path, f"agent: starting {inst.instance_id}: {' '.join(argv)}"
            )
            with log_file:
                inst.proc = EngineProcess.start(
                    argv,
                    env=env,
                    log_file=log_file,
                    cwd=self._log_dir,
                    loop=asyncio.get_running_loop(),
                )
        except OSError as exc:
            inst.pending_since = None
            self._fail(inst, f"llama-server could not be started: {exc.strerror or exc}", None)
            return False
        inst.pid = inst.proc.pid
        inst.started_at = time.time()
        with contextlib.suppress(psutil.Error):
            ps = psutil.Process(inst.pid)
            with ps.oneshot():
                inst.pid_create_time, inst.pid_cmdline = ps.create_time(), ps.cmdline()
                inst.pid_exe = ps.exe()
        inst.pending_since = None
        log.info(
            "Started %s (pid %s, port %s, restart %s): %s",
            inst.instance_id,
            inst.pid,
            inst.port,
            inst.restart_count,
            " ".join(argv),
        )
        self._changed(inst)
        return True

    def _fail(self, inst: Instance, error: str, exit_code: int | None) -> None:
        log_path = self._log_dir / f"ss-{inst.instance_id}.log"
        inst.state = FAILED
        inst.error = error
        inst.exit_code = exit_code
        inst.log_tail = read_log_tail(log_path, inst.log_offset)
        inst.pid = None
        inst.proc = None
        inst.pending_since = None
        inst.start_queued_at = None
        inst.measured = None
        self._ports.release(inst.port)
        self._release_gpus(inst)
        log.error("Instance %s failed: %s", inst.instance_id, error)
        self._changed(inst)

    # -- supervision -----------------------------------------------------------------

    async def _probe(self, inst: Instance) -> bool:
        assert self._session is not None
        return await engine_ready(
            self._session, f"http://127.0.0.1:{inst.port}", key=inst.key, alias=inst.alias
        )

    async def _wait_ready(self, inst: Instance, proc: EngineProcess | AdoptedProcess) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.process_start_timeout_seconds
        waiter = asyncio.ensure_future(proc.wait())
        try:
            while True:
                if waiter.done():
                    return "exited"
                if await self._probe(inst):
                    return "ready"
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return "timeout"
                done, _ = await asyncio.wait({waiter}, timeout=min(self._poll, remaining))
                if done:
                    return "exited"
        finally:
            if not waiter.done():
                waiter.cancel()

    async def _supervise(self, inst: Instance, *, queued: bool = False) -> None:
        """Wait for Ready, measure, then watch for the exit and restart within budget.

        ``queued``: the start still waits for its GPUs; this task starts it first.
        """
        try:
            if queued and not await self._start_queued(inst):
                return
            while True:
                proc = inst.proc
                assert proc is not None
                outcome = await self._wait_ready(inst, proc)
                # Before the Ready event, so the event already carries the measurement.
                measured = await self._measure(inst) if outcome == "ready" else None
                async with inst.lock:
                    if inst.stopping:
                        return
                    if outcome == "exited":
                        proc.kill_leftovers()
                        code = await proc.wait()
                        self._fail(
                            inst, f"llama-server {exit_text(code)} before it was ready", code
                        )
                        return
                    if outcome == "timeout":
                        code = await proc.kill_group(self._grace)
                        self._fail(
                            inst,
                            "llama-server was not ready after "
                            f"{self._config.process_start_timeout_seconds:g} s "
                            "(ProcessStartTimeoutSeconds); it was stopped",
                            code,
                        )
                        return
                    inst.state = READY
                    inst.ready_at = time.time()
                    if measured is not None:
                        inst.measured = measured
                    # Its memory is measured: the next start on these GPUs may go.
                    self._release_gpus(inst)
                    log.info(
                        "Instance %s is Ready on port %s%s",
                        inst.instance_id,
                        inst.port,
                        " (adopted)" if inst.adopted else "",
                    )
                    self._changed(inst)
                code = await self._wait_exit(inst, proc)
                queued = False
                async with inst.lock:
                    if inst.stopping:
                        return
                    proc.kill_leftovers()
                    now = time.monotonic()
                    window = self._config.restart_window_seconds
                    while inst.restarts and inst.restarts[0] < now - window:
                        inst.restarts.popleft()
                    if len(inst.restarts) >= self._config.restart_budget:
                        self._fail(
                            inst,
                            f"llama-server {exit_text(code)} after it was ready; it already "
                            f"restarted {len(inst.restarts)} times in the last {window:g} s "
                            "(RestartBudget)",
                            code,
                        )
                        return
                    inst.restarts.append(now)
                    inst.restart_count += 1
                    log.warning(
                        "Instance %s: llama-server %s after it was ready; restarting (%d of %d)",
                        inst.instance_id,
                        exit_text(code),
                        len(inst.restarts),
                        self._config.restart_budget,
                    )
                    # A restart is a start too: one per GPU at a time.
                    gpus = inst.spec.gpu_uuids
                    queued = bool(gpus) and not self._gpu_locks.free(gpus)
                    if queued:
                        self._queue_restart(inst)
                    else:
                        if gpus:
                            inst.gpu_held = await self._gpu_locks.take(gpus)
                        if not await self._spawn(inst):
                            return
                if queued and not await self._start_queued(inst):
                    return
        except asyncio.CancelledError:
            self._release_gpus(inst)
            raise
        except Exception as exc:
            log.exception("The supervisor of %s crashed", inst.instance_id)
            async with inst.lock:
                if inst.proc is not None:
                    await inst.proc.kill_group(self._grace)
                self._fail(inst, f"the agent's supervisor failed: {exc}", None)

    # -- stop and delete -------------------------------------------------------------

    async def stop(self, instance_id: str) -> dict[str, Any]:
        """Kill the engine's process group; the instance ends Stopped."""
        inst = self.get(instance_id)
        async with inst.lock:
            if inst.state == STOPPED:
                return inst.to_json()
            inst.stopping = True
            task, inst.task = inst.task, None
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if inst.proc is not None:
                inst.exit_code = await inst.proc.kill_group(self._grace)
                log.info("Stopped %s (exit %s)", inst.instance_id, inst.exit_code)
            inst.state = STOPPED
            inst.pid = None
            inst.proc = None
            inst.pending_since = None
            inst.start_queued_at = None
            inst.measured = None
            inst.gpu_baseline = None
            inst.error = None
            inst.log_tail = []
            self._ports.release(inst.port)
            self._release_gpus(inst)
            self._changed(inst)
            return inst.to_json()

    async def delete(self, instance_id: str) -> None:
        """Stop the instance if needed and forget it."""
        # Under the launch lock, so a launch cannot slip in between the stop and the pop
        # and leave a running engine nobody knows about.
        async with self._launch_lock:
            await self.stop(instance_id)
            self._instances.pop(instance_id, None)
            self._persist_quietly()

    def upstream(self, instance_id: str) -> Instance:
        """The instance to proxy to; raises NotFound or ModelNotRunning."""
        inst = self.get(instance_id)
        if inst.state != READY or inst.port is None:
            raise ModelNotRunning(
                f"model {inst.spec.served_name!r} (instance {instance_id}) is {inst.state}, not Ready"
            )
        return inst
