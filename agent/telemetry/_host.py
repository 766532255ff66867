"""Host telemetry (psutil) and the node's health reasons.

Telemetry is sampled every 5 s in the background (:class:`Telemetry`); the endpoint
answers the latest sample. Health is a set of reason codes,
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

import aiohttp
import psutil

from agent._util import utc_now_iso
from agent.state import EventBus
from agent.telemetry._describe import GpuSampler
from agent.telemetry._engines import (
    MAX_METRICS_BYTES,
    SCRAPE_TIMEOUT_SECONDS,
    EngineTarget,
    GroupMeter,
    MetricsError,
    scrape,
)

__all__ = ["HealthMonitor", "Telemetry", "host_facts"]

log = logging.getLogger("mirbad.agent.telemetry")

MODEL_ROOT_LOW_FRACTION = 0.05
# The per-GPU fields of a telemetry sample (a field the probe could not read is absent).
TELEMETRY_GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "memoryTotalBytes",
    "memoryUsedBytes",
    "utilizationPercent",
)
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
    """The 5-second sampler: CPU, load, memory, disks, GPUs and every running engine.

    :meth:`start` runs :meth:`collect` every ``interval`` seconds and keeps the latest
    sample; :meth:`current` answers it (taking one at once when there is none yet). The
    blocking parts (psutil, the process-group scan, nvidia-smi) run in threads, and the
    engines' ``/metrics`` are scraped concurrently, so nothing waits on the event loop
    (docs/decisions.md D61).
    """

    def __init__(
        self,
        *,
        models_root: Path,
        state_directory: Path,
        engines: Callable[[], list[EngineTarget]] | None = None,
        gpus: GpuSampler | None = None,
        interval: float = 5.0,
        scrape_timeout: float = SCRAPE_TIMEOUT_SECONDS,
        max_metrics_bytes: int = MAX_METRICS_BYTES,
    ) -> None:
        self._paths = [models_root, state_directory]
        self._engines = engines or list
        self._gpus = gpus
        self._interval = interval
        self._scrape_timeout = scrape_timeout
        self._max_metrics_bytes = max_metrics_bytes
        self._meter = GroupMeter()
        self._latest: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        # cpu_percent(interval=None) compares against the previous call; priming it here
        # makes the first real sample meaningful without ever blocking the event loop.
        psutil.cpu_percent(interval=None)
        psutil.cpu_percent(interval=None, percpu=True)

    def disk(self, path: Path) -> dict[str, Any]:
        usage = psutil.disk_usage(str(_existing(path)))
        return {
            "path": str(path),
            "totalBytes": usage.total,
            "freeBytes": usage.free,
            "percent": usage.percent,
        }

    def sample(self) -> dict[str, Any]:
        """The host part of a sample: CPU, load, memory, disks (blocking; use a thread)."""
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
            "cpuPerCore": psutil.cpu_percent(interval=None, percpu=True),
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

    def _host_and_groups(self, leaders: list[int]) -> tuple[dict[str, Any], dict[int, Any]]:
        return self.sample(), self._meter.measure(leaders)

    async def _gpu_list(self) -> list[dict[str, Any]]:
        if self._gpus is None:
            return []
        gpus, _ = await self._gpus.current()
        return [{k: g[k] for k in TELEMETRY_GPU_FIELDS if k in g} for g in gpus]

    async def _metrics(self, target: EngineTarget) -> dict[str, Any]:
        if not target.ready or target.port is None:
            return {"metricsError": f"not scraped: the instance is {target.state}"}
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0)
            )
        try:
            found = await scrape(
                self._session,
                target.port,
                target.key,
                time_limit=self._scrape_timeout,
                max_bytes=self._max_metrics_bytes,
            )
        except MetricsError as exc:
            return {"metricsError": str(exc)}
        return {"metrics": found}

    async def collect(self) -> dict[str, Any]:
        """Take one full sample now and keep it as the latest."""
        async with self._lock:
            targets = self._engines()
            host_groups, gpus, *scraped = await asyncio.gather(
                asyncio.to_thread(self._host_and_groups, [t.pid for t in targets]),
                self._gpu_list(),
                *(self._metrics(t) for t in targets),
            )
            host, groups = host_groups
            engines = []
            for target, metrics in zip(targets, scraped, strict=True):
                group = groups.get(target.pid, {"cpuPercent": 0.0, "rssBytes": 0})
                engines.append(
                    {
                        "instanceId": target.instance_id,
                        "state": target.state,
                        "pid": target.pid,
                        **group,
                        **metrics,
                    }
                )
            self._latest = {**host, "gpus": gpus, "engines": engines}
            return self._latest

    async def current(self) -> dict[str, Any]:
        """The latest sample, or one taken now when the sampler has none yet."""
        if self._latest is None:
            return await self.collect()
        return self._latest

    async def _loop(self) -> None:
        while True:
            try:
                await self.collect()
            except Exception:
                log.exception("The telemetry sample failed")
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        """Sample every ``interval`` seconds in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="telemetry-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None


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
