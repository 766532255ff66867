"""Host telemetry (psutil) and the node's health reasons.

Telemetry is a plain snapshot taken on demand. Health is a set of reason codes,
recomputed every HealthCheckIntervalSeconds; a ``health`` event goes out only when the
set of codes changes, so the master's stream is not flooded with identical states.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from agent._util import utc_now_iso
from agent.state import EventBus

__all__ = ["HealthMonitor", "Telemetry", "host_facts"]

log = logging.getLogger("mirbad.agent.telemetry")

MODEL_ROOT_LOW_FRACTION = 0.05
_GIB = 1024**3


def host_facts() -> dict[str, Any]:
    """The static facts /info reports about the machine."""
    return {
        "os": platform.system(),
        "arch": platform.machine(),
        "hostname": platform.node(),
        "cpuCount": psutil.cpu_count() or os.cpu_count() or 1,
        "memoryTotalBytes": psutil.virtual_memory().total,
    }


def _existing(path: Path) -> Path:
    # disk_usage needs an existing path; a missing folder reports its parent's volume.
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


class Telemetry:
    """psutil samples of CPU, load, memory and the two disks the agent cares about."""

    def __init__(self, *, models_root: Path, state_directory: Path) -> None:
        self._paths = [models_root, state_directory]
        # cpu_percent(interval=None) compares against the previous call; priming it here
        # makes the first real sample meaningful without ever blocking the event loop.
        psutil.cpu_percent(interval=None)

    def disk(self, path: Path) -> dict[str, Any]:
        usage = psutil.disk_usage(str(_existing(path)))
        return {
            "path": str(path),
            "totalBytes": usage.total,
            "freeBytes": usage.free,
            "percent": usage.percent,
        }

    def sample(self) -> dict[str, Any]:
        """One telemetry sample in the contract's shape."""
        memory = psutil.virtual_memory()
        try:
            load = [round(v, 2) for v in os.getloadavg()]
        except OSError:
            load = [0.0, 0.0, 0.0]
        disks: list[dict[str, Any]] = []
        for path in self._paths:
            with contextlib.suppress(OSError):
                disks.append(self.disk(path))
        return {
            "time": utc_now_iso(),
            "cpuPercent": psutil.cpu_percent(interval=None),
            "cpuCount": psutil.cpu_count() or 1,
            "load": load,
            "memory": {
                "totalBytes": memory.total,
                "availableBytes": memory.available,
                "usedBytes": memory.used,
                "percent": memory.percent,
            },
            "disks": disks,
        }


def check_models_root(models_root: Path) -> dict[str, str] | None:
    """model_root_low when under 5 % of the models root's volume is free."""
    try:
        usage = psutil.disk_usage(str(_existing(models_root)))
    except OSError as exc:
        return {
            "code": "model_root_low",
            "message": f"Cannot read free space of {models_root}: {exc}.",
        }
    if usage.total and usage.free / usage.total < MODEL_ROOT_LOW_FRACTION:
        return {
            "code": "model_root_low",
            "message": (
                f"The models root {models_root} has {usage.free / usage.total:.1%} free "
                f"({usage.free / _GIB:.1f} of {usage.total / _GIB:.1f} GiB); free space or "
                "move models elsewhere."
            ),
        }
    return None


def check_state_directory(state_directory: Path) -> dict[str, str] | None:
    """state_unavailable when a probe file cannot be written and fsynced in the state dir."""
    probe = state_directory / ".health-probe"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"ok")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as exc:
        return {
            "code": "state_unavailable",
            "message": (
                f"The state directory {state_directory} is not writable ({exc.strerror or exc}); "
                "the agent cannot persist instances. Fix its permissions or disk."
            ),
        }
    return None


class HealthMonitor:
    """Recomputes the health reasons periodically and publishes changes of the code set."""

    def __init__(
        self,
        *,
        models_root: Path,
        state_directory: Path,
        bus: EventBus,
        interval: float,
        extra_checks: list[Callable[[], list[dict[str, str]]]] | None = None,
    ) -> None:
        self._models_root = models_root
        self._state_directory = state_directory
        self._bus = bus
        self._interval = interval
        self._extra = list(extra_checks or [])
        self.reasons: list[dict[str, str]] = []
        self._task: asyncio.Task[None] | None = None

    def compute(self) -> list[dict[str, str]]:
        """All current reasons, sorted by code (blocking I/O; run it in a thread)."""
        reasons = [
            r
            for r in (
                check_models_root(self._models_root),
                check_state_directory(self._state_directory),
            )
            if r
        ]
        for check in self._extra:
            reasons.extend(check())
        return sorted(reasons, key=lambda r: (r["code"], r["message"]))

    async def refresh(self) -> bool:
        """Recompute now; publish a health event when the set of codes changed."""
        reasons = await asyncio.to_thread(self.compute)
        changed = {r["code"] for r in reasons} != {r["code"] for r in self.reasons}
        self.reasons = reasons
        if changed:
            log.info("Health reasons are now: %s", [r["code"] for r in reasons] or "none")
            self._bus.publish("health", {"reasons": reasons})
        return changed

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.refresh()
            except Exception:
                log.exception("The health check failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="health-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
