"""One engine instance's state as the process runtime keeps, reports and persists it."""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from pathlib import Path
from typing import Any

from agent._util import iso_time
from agent.engines._executables import ExecutableInfo
from agent.engines._measure import Measured
from agent.engines._spec import LaunchSpec, fingerprint
from agent.engines.process._handle import AdoptedProcess, EngineProcess
from protocol.states import InstanceState

__all__ = [
    "FAILED",
    "GONE_ERROR",
    "PENDING_ERROR",
    "PENDING_STOPPED_ERROR",
    "QUEUED_ERROR",
    "READY",
    "STARTING",
    "STOPPED",
    "Instance",
]

STARTING, READY, FAILED, STOPPED = (
    InstanceState.STARTING,
    InstanceState.READY,
    InstanceState.FAILED,
    InstanceState.STOPPED,
)
GONE_ERROR = "The engine was gone after the agent restarted."
PENDING_ERROR = "The agent restarted while it was starting the engine."
PENDING_STOPPED_ERROR = (
    "The agent restarted while it was starting the engine; the engine was stopped."
)
QUEUED_ERROR = "The agent restarted while the start was waiting for its GPUs; it was not started."


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
        self.proc: EngineProcess | AdoptedProcess | None = None
        self.task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.stopping = False
        self.log_offset = 0
        # Set from just before a start is recorded until the process exists.
        self.pending_since: float | None = None
        self.argv_digest: str | None = None
        self.pid_exe: str | None = None
        self.adopted = False
        # Set while the start waits for a GPU another start holds.
        self.start_queued_at: float | None = None
        # The GPU locks this instance's start holds (released at Ready, Failed, stop).
        self.gpu_held: list[asyncio.Lock] = []
        self.measured: Measured | None = None
        # memory.used per placed GPU just before the process was created.
        self.gpu_baseline: dict[str, int] | None = None

    @property
    def instance_id(self) -> str:
        """The master's id of this instance."""
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
            "gpuUuids": list(self.spec.gpu_uuids),
            "startQueuedAt": iso_time(self.start_queued_at) if self.start_queued_at else None,
            "measured": self.measured.to_json() if self.measured else None,
        }

    def to_record(self) -> dict[str, Any]:
        """What processes.json keeps: the public view plus what adoption needs."""
        return {
            **self.to_json(),
            "spec": self.spec.to_json(),
            "apiKey": self.key,
            "pendingStart": self.pending_since is not None,
            "pendingSince": self.pending_since,
            "argvDigest": self.argv_digest,
            "pidCreateTime": self.pid_create_time,
            "pidCmdline": self.pid_cmdline,
            "pidExe": self.pid_exe,
            "executablePath": str(self.executable.path.resolve()),
            "modelPath": str(self.model_path) if self.model_path.parts else None,
            "startedAtEpoch": self.started_at,
            "readyAtEpoch": self.ready_at,
            "gpuBaselineBytes": self.gpu_baseline,
        }
