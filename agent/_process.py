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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from agent._atomic import write_atomic
from agent._config import AgentConfig
from agent._engine import EngineProcess, PortAllocator, exit_text, open_log, read_log_tail
from agent._errors import Conflict, ModelNotRunning, NotFound, StateUnavailable
from agent._events import EventBus
from agent._executables import Catalogue, ExecutableInfo
from agent._spec import (
    LaunchSpec,
    check_args,
    check_env,
    check_runtime,
    fingerprint,
    parse_launch_spec,
    resolve_model_path,
    substitute,
)
from agent._util import iso_time

__all__ = ["Instance", "ProcessRuntime"]

log = logging.getLogger("mirbad.agent.process")

STARTING, READY, FAILED, STOPPED = "Starting", "Ready", "Failed", "Stopped"
_BASE_ENV = ("PATH", "HOME", "LANG")
PROCESSES_FILE = "processes.json"


class Instance:
    """One instance's mutable state; only the runtime changes it, under ``lock``."""

    def __init__(
        self, *, spec: LaunchSpec, executable: ExecutableInfo, alias: str, model_path: Path
    ) -> None:
        self.spec = spec
        self.executable = executable
        self.alias = alias
        self.model_path = model_path
        self.key = secrets.token_urlsafe(32)
        self.fingerprint = fingerprint(spec, executable.version)
        self.state = STARTING
        self.port: int | None = None
        self.pid: int | None = None
        self.pid_create_time: float | None = None
        self.pid_cmdline: list[str] = []
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self.log_tail: list[str] = []
        self.restart_count = 0
        self.restarts: deque[float] = deque()
        self.proc: EngineProcess | None = None
        self.task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.stopping = False
        self.log_offset = 0

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    def to_json(self) -> dict[str, Any]:
        """The contract's ``<instance>``; never includes the key."""
        return {
            "instanceId": self.spec.instance_id,
            "modelId": self.spec.model_id,
            "servedName": self.spec.served_name,
            "state": self.state,
            "port": self.port,
            "pid": self.pid,
            "startedAt": iso_time(self.started_at) if self.started_at else None,
            "readyAt": iso_time(self.ready_at) if self.ready_at else None,
            "exitCode": self.exit_code,
            "error": self.error,
            "logTail": list(self.log_tail),
            "fingerprint": self.fingerprint,
            "restartCount": self.restart_count,
            "executable": {"name": self.executable.name, "version": self.executable.version},
        }

    def to_record(self) -> dict[str, Any]:
        """What processes.json keeps: the public view plus what adoption needs."""
        return {
            **self.to_json(),
            "spec": self.spec.to_json(),
            "apiKey": self.key,
            "pidCreateTime": self.pid_create_time,
            "pidCmdline": self.pid_cmdline,
            "executablePath": str(self.executable.path.resolve()),
        }


class ProcessRuntime:
    """All instances of this agent, and the supervisor task of each."""

    def __init__(
        self,
        *,
        config: AgentConfig,
        catalogue: Catalogue,
        bus: EventBus,
        ready_poll_interval: float = 0.5,
        stop_grace_seconds: float = 10.0,
    ) -> None:
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

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the probe session and clean up after a previous run of the agent."""
        self._log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=5), connector=aiohttp.TCPConnector(force_close=True)
        )
        await self._reap_previous_run()

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
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _reap_previous_run(self) -> None:
        try:
            data = json.loads(self._state_file.read_text(encoding="utf-8"))
            records = data["instances"]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("Cannot read %s (%s); starting with no instances", self._state_file, exc)
            return
        for record in records:
            pid = record.get("pid")
            if pid and self._provably_ours(record):
                log.warning(
                    "Stopping engine pid %s of instance %s left by a previous agent run",
                    pid,
                    record.get("instanceId"),
                )
                await asyncio.to_thread(self._kill_foreign_group, pid)
            try:
                spec = parse_launch_spec(record["spec"])
                exe = self._catalogue.resolve(spec.executable_name, spec.executable_version)
            except Exception as exc:
                log.warning("Forgetting instance %s: %s", record.get("instanceId"), exc)
                continue
            inst = Instance(spec=spec, executable=exe, alias="", model_path=Path())
            inst.state = STOPPED
            inst.exit_code = record.get("exitCode")
            if record.get("state") in (STARTING, READY):
                inst.error = "The agent restarted; the engine was stopped."
            self._instances[spec.instance_id] = inst
        self._persist_quietly()

    def _provably_ours(self, record: dict[str, Any]) -> bool:
        # Only a process with the recorded pid, creation time and command line (which
        # starts with the executable's path) is ours; anything that reuses the pid is not.
        try:
            proc = psutil.Process(record["pid"])
            same_time = abs(proc.create_time() - float(record.get("pidCreateTime") or 0)) < 0.05
            cmdline = record.get("pidCmdline")
            return same_time and bool(cmdline) and proc.cmdline() == cmdline
        except (psutil.Error, KeyError, TypeError, ValueError):
            return False

    def _kill_foreign_group(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

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
        body = {"version": 1, "instances": [i.to_record() for i in self._instances.values()]}
        try:
            write_atomic(self._state_file, json.dumps(body, indent=1).encode(), mode=0o600)
        except OSError as exc:
            raise StateUnavailable(
                f"cannot write {self._state_file}: {exc.strerror or exc}"
            ) from None

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
        """Validate and start an instance; idempotent for an identical running spec."""
        spec = parse_launch_spec(body)
        check_runtime(spec)
        alias = check_args(spec.args)
        check_env(spec.env)
        model_path = resolve_model_path(
            self._config.models_root_path, spec.model_folder, spec.model_file
        )
        exe = self._catalogue.resolve(spec.executable_name, spec.executable_version)
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
            inst.port = await self._ports.reserve()
            self._instances[spec.instance_id] = inst
            try:
                self._persist()
            except StateUnavailable:
                self._ports.release(inst.port)
                if current is not None:
                    self._instances[spec.instance_id] = current
                else:
                    del self._instances[spec.instance_id]
                raise
            async with inst.lock:
                started = await self._spawn(inst)
            if started:
                inst.task = asyncio.create_task(
                    self._supervise(inst), name=f"supervise-{inst.instance_id}"
                )
            return inst.to_json()

    async def _spawn(self, inst: Instance) -> bool:
        """Start the engine process; False (and the instance Failed) if it cannot start."""
        assert inst.port is not None
        argv = [
            str(inst.executable.path),
            *substitute(inst.spec.args, model_path=inst.model_path, port=inst.port),
        ]
        env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
        env.update(inst.spec.env_dict)
        env["LLAMA_API_KEY"] = inst.key
        log_path = self._log_dir / f"ss-{inst.instance_id}.log"
        inst.state = STARTING
        inst.ready_at = None
        inst.exit_code = None
        inst.error = None
        inst.log_tail = []
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
            self._fail(inst, f"llama-server could not be started: {exc.strerror or exc}", None)
            return False
        inst.pid = inst.proc.pid
        inst.started_at = time.time()
        with contextlib.suppress(psutil.Error):
            ps = psutil.Process(inst.pid)
            inst.pid_create_time, inst.pid_cmdline = ps.create_time(), ps.cmdline()
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
        self._ports.release(inst.port)
        log.error("Instance %s failed: %s", inst.instance_id, error)
        self._changed(inst)

    # -- supervision -----------------------------------------------------------------

    async def _probe(self, inst: Instance) -> bool:
        assert self._session is not None
        base = f"http://127.0.0.1:{inst.port}"
        try:
            async with self._session.get(base + "/health") as resp:
                if resp.status != 200:
                    return False
            headers = {"Authorization": f"Bearer {inst.key}"}
            async with self._session.get(base + "/v1/models", headers=headers) as resp:
                if resp.status != 200:
                    return False
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        return inst.alias in _listed_names(body)

    async def _wait_ready(self, inst: Instance, proc: EngineProcess) -> str:
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

    async def _supervise(self, inst: Instance) -> None:
        try:
            while True:
                proc = inst.proc
                assert proc is not None
                outcome = await self._wait_ready(inst, proc)
                async with inst.lock:
                    if inst.stopping:
                        return
                    if outcome == "exited":
                        proc.kill_leftovers()
                        code = proc.returncode if proc.returncode is not None else -1
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
                    log.info("Instance %s is Ready on port %s", inst.instance_id, inst.port)
                    self._changed(inst)
                code = await proc.wait()
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
                    if not await self._spawn(inst):
                        return
        except asyncio.CancelledError:
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
            inst.error = None
            inst.log_tail = []
            self._ports.release(inst.port)
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


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a non-reaping init does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _listed_names(body: Any) -> set[str]:
    names: set[str] = set()
    if not isinstance(body, dict):
        return names
    for item in body.get("data") or []:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            names.add(item["id"])
    for item in body.get("models") or []:
        if isinstance(item, dict):
            names.update(v for v in (item.get("name"), item.get("model")) if isinstance(v, str))
    return names
