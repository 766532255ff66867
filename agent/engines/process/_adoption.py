"""Adoption after an agent restart: the part of the process runtime that reads the
previous run's ``processes.json`` and decides, per record, adopt / gone / stop orphan
(see :mod:`agent.engines.process._runtime` for the rules and :mod:`agent.engines.process._reconcile` for how a
process is identified).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent._errors import SpecRejected
from agent.engines._executables import Catalogue
from agent.engines._measure import Measured, is_int
from agent.engines._spec import check_args, parse_launch_spec, resolve_model_path
from agent.engines.process._handle import AdoptedProcess, PortAllocator, open_pidfd
from agent.engines.process._instance import (
    FAILED,
    GONE_ERROR,
    PENDING_ERROR,
    PENDING_STOPPED_ERROR,
    QUEUED_ERROR,
    READY,
    STARTING,
    STOPPED,
    Instance,
)
from agent.engines.process._reconcile import (
    Observed,
    Pending,
    matches_record,
    observe,
    scan,
    stop_group,
)
from agent.engines.process._records import read_records
from agent.state import EventBus

if TYPE_CHECKING:
    from agent._config import AgentConfig

__all__ = ["Adoption", "runtime_folders"]

log = logging.getLogger("mirbad.agent.process")


def runtime_folders(config: AgentConfig) -> list[Path]:
    """The configured executables' folders: only processes run from there can be ours."""
    return sorted({entry.path.parent.resolve() for entry in config.executables})


class Adoption:
    """Mixed into ProcessRuntime, whose state it uses (declared here for the reader)."""

    _config: AgentConfig
    _catalogue: Catalogue
    _bus: EventBus
    _grace: float
    _ports: PortAllocator
    _instances: dict[str, Instance]
    _state_file: Path
    _log_dir: Path

    def _persist_quietly(self) -> None:
        raise NotImplementedError

    async def _supervise(self, inst: Instance, *, queued: bool = False) -> None:
        raise NotImplementedError

    def _runtime_folders(self) -> list[Path]:
        return runtime_folders(self._config)

    def _read_records(self) -> list[dict[str, Any]] | None:
        return read_records(self._state_file, unreadable="starting with no instances")

    def _instance_from_record(self, record: dict[str, Any]) -> Instance:
        """The instance a record describes, Stopped; raises when it cannot be managed."""
        spec = parse_launch_spec(record["spec"])
        exe = self._catalogue.resolve(spec.executable_name, spec.executable_version)
        try:
            alias = check_args(spec.args, exe.version)
        except SpecRejected:
            alias = ""
        model_path = Path(record["modelPath"]) if record.get("modelPath") else Path()
        inst = Instance(spec=spec, executable=exe, alias=alias, model_path=model_path)
        inst.state = STOPPED
        if isinstance(record.get("apiKey"), str) and record["apiKey"]:
            inst.key = record["apiKey"]
        port = record.get("port")
        inst.port = port if isinstance(port, int) else None
        count = record.get("restartCount")
        inst.restart_count = count if isinstance(count, int) else 0
        inst.exit_code = record.get("exitCode")
        if record.get("state") == FAILED:
            inst.state = FAILED
            inst.error = record.get("error")
            tail = record.get("logTail")
            inst.log_tail = [str(line) for line in tail] if isinstance(tail, list) else []
        return inst

    def _adoptable(self, inst: Instance, record: dict[str, Any]) -> str | None:
        """None when ``inst`` can be supervised again, else why not."""
        if not inst.alias:
            return "its spec has no usable --alias"
        if not isinstance(record.get("apiKey"), str) or not record["apiKey"]:
            return "its record has no API key"
        if not isinstance(record.get("port"), int):
            return "its record has no port"
        if str(inst.executable.path.resolve()) != record.get("executablePath"):
            return f"its executable is now configured as {inst.executable.path}"
        if not inst.model_path.parts:
            try:
                inst.model_path = resolve_model_path(
                    self._config.models_root_path, inst.spec.model_folder, inst.spec.model_file
                )
            except SpecRejected as exc:
                return exc.message
        return None

    async def _reconcile(self) -> None:
        """Adopt, mark gone, and stop orphans, from the previous run's processes.json."""
        records = self._read_records()
        if records is None:
            return
        loop = asyncio.get_running_loop()
        folders = self._runtime_folders()
        adopted: list[Instance] = []
        gone = 0
        kills: list[tuple[Observed, str, str]] = []  # (process, instance, why)
        pending: list[Pending] = []
        ports: dict[int, str] = {}
        for record in records:
            iid = str(record.get("instanceId"))
            try:
                inst: Instance | None = self._instance_from_record(record)
                problem = None
            except Exception as exc:
                inst, problem = None, str(getattr(exc, "message", exc))
            port = record.get("port")
            pid = record.get("pid")
            if record.get("pendingStart"):
                digest, since = record.get("argvDigest"), record.get("pendingSince")
                if isinstance(digest, str) and isinstance(since, int | float):
                    pending.append(Pending(instance_id=iid, digest=digest, since=float(since)))
                if inst is not None:
                    inst.error = PENDING_ERROR
            elif record.get("startQueuedAt") and not isinstance(pid, int):
                # It never got its GPUs, so there is no process to look for.
                if inst is not None:
                    inst.error = QUEUED_ERROR
            elif record.get("state") in (STARTING, READY) and isinstance(pid, int) and pid > 0:
                # The pidfd first: once the identity is checked it cannot be a later process.
                pidfd = open_pidfd(pid)
                obs = await asyncio.to_thread(observe, pid, folders)
                ours = obs is not None and matches_record(obs, record)
                why_not = None
                if ours and inst is not None:
                    why_not = self._adoptable(inst, record)
                if ours and inst is not None and why_not is None:
                    assert obs is not None
                    self._adopt(inst, record, obs, pidfd, loop)
                    adopted.append(inst)
                    self._instances[inst.instance_id] = inst
                    continue
                if pidfd is not None:
                    os.close(pidfd)
                if ours:
                    assert obs is not None
                    log.warning(
                        "Engine pid %s of instance %s cannot be adopted: %s",
                        pid,
                        iid,
                        why_not or problem,
                    )
                    kills.append((obs, iid, "unmanageable"))
                    if inst is not None:
                        inst.error = (
                            f"The agent restarted and could not adopt the engine ({why_not}); "
                            "it was stopped."
                        )
                else:
                    gone += 1
                    if inst is not None:
                        inst.error = GONE_ERROR
                    log.warning(
                        "Instance %s: engine pid %s was gone after the agent restarted", iid, pid
                    )
            if isinstance(port, int):
                ports.setdefault(port, iid)
            if inst is None:
                log.warning("Forgetting instance %s: %s", iid, problem)
                continue
            inst.port = None if inst.state == STOPPED else inst.port
            self._instances[inst.instance_id] = inst
        if pending or ports or kills:
            skip = {os.getpid(), *(i.pid for i in adopted if i.pid), *(k[0].pid for k in kills)}
            findings = await asyncio.to_thread(
                scan, folders=folders, pending=pending, ports=ports, skip=skip
            )
            for finding in findings:
                if finding.instance_id is None:
                    log.warning(
                        "Foreign process pid %s (%s): left alone",
                        finding.obs.pid,
                        finding.obs.program,
                    )
                else:
                    kills.append((finding.obs, finding.instance_id, finding.why))
        stopped = 0
        for obs, iid, why in kills:
            if await asyncio.to_thread(stop_group, obs, self._grace):
                stopped += 1
                log.warning("Stopped orphan engine pid %s (instance %s)", obs.pid, iid)
                inst = self._instances.get(iid)
                if why == "pending" and inst is not None and inst.state == STOPPED:
                    inst.error = PENDING_STOPPED_ERROR
        self._persist_quietly()
        log.info("Reconciled: adopted %d, gone %d, orphans stopped %d", len(adopted), gone, stopped)
        for inst in adopted:
            inst.task = asyncio.create_task(
                self._supervise(inst), name=f"supervise-{inst.instance_id}"
            )

    def _adopt(
        self,
        inst: Instance,
        record: dict[str, Any],
        obs: Observed,
        pidfd: int | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        assert inst.port is not None
        inst.adopted = True
        inst.state = STARTING
        inst.error = None
        inst.exit_code = None
        inst.pid = obs.pid
        inst.pid_create_time = obs.create_time
        inst.pid_cmdline = list(obs.cmdline)
        inst.pid_exe = obs.exe
        inst.argv_digest = record.get("argvDigest") or obs.digest
        started = record.get("startedAtEpoch")
        inst.started_at = float(started) if isinstance(started, int | float) else obs.create_time
        # The engine is the same process, so what was measured at its start still holds
        # (a GPU delta cannot be taken again: the "before" is long gone).
        inst.measured = Measured.from_json(record.get("measured"))
        baseline = record.get("gpuBaselineBytes")
        if isinstance(baseline, dict):
            inst.gpu_baseline = {str(k): v for k, v in baseline.items() if is_int(v)}
        log_path = self._log_dir / f"ss-{inst.instance_id}.log"
        with contextlib.suppress(OSError):
            inst.log_offset = log_path.stat().st_size
        self._ports.claim(inst.port)
        inst.proc = AdoptedProcess(pid=obs.pid, create_time=obs.create_time, pidfd=pidfd, loop=loop)
        log.info("Adopted instance %s (pid %s, port %s)", inst.instance_id, obs.pid, inst.port)
        self._bus.publish("instance", inst.to_json())
