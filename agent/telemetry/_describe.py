"""What the agent tells the master about its machine (self-description).

Static facts (OS, CPU, addresses, GPUs, engines) go into ``/info``; memory and
disk change, so they are sampled again for every heartbeat. GPUs are read with
``nvidia-smi`` when it exists; a probe that fails is a health reason only on a
node configured to have GPUs (``GpusExpected``).

``nvidia-smi`` can take a second or hang on a wedged driver, so nothing on the event
loop calls :func:`probe_gpus` directly: :class:`GpuSampler` runs it in a thread and
keeps the last answer for the heartbeat. :func:`group_rss` measures what an engine's
process group holds in RAM (the "measured" figure of a start without GPUs).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import platform
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from agent.telemetry import _nvml

log = logging.getLogger("mirbad.agent.describe")

# What probe_gpus answers on a machine without the NVIDIA driver: not a failure, just no
# GPUs, so it is neither a heartbeat error nor worth a log line per heartbeat.
NVIDIA_SMI_ABSENT = "nvidia-smi is not installed"
# The GPU fields every heartbeat carries (driverVersion is static: /info has it).
HEARTBEAT_GPU_FIELDS = ("index", "uuid", "name", "memoryTotalBytes", "memoryUsedBytes")
# What probe_gpus asks nvidia-smi, in the column order parse_gpus reads.
GPU_QUERY = "index,uuid,name,memory.total,memory.used,driver_version,utilization.gpu"

GpuProbe = Callable[[], tuple[list[dict[str, Any]], str | None]]

# The instruction-set features engines care about when picking a build.
CPU_FEATURES = ("sse4_2", "avx", "avx2", "avx512f", "avx512_bf16", "fma", "f16c", "amx_tile")


def cpu_info() -> dict[str, Any]:
    """The CPU model, its logical and physical counts and the features engines care about."""
    model = platform.processor() or ""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    features = [f for f in CPU_FEATURES if f in flags]
    if platform.machine() in ("aarch64", "arm64"):
        features.append("neon")
    return {
        "model": model,
        "count": psutil.cpu_count() or 1,
        "physicalCount": psutil.cpu_count(logical=False),
        "features": features,
    }


def addresses() -> list[str]:
    """Non-loopback IP addresses of this machine."""
    found: list[str] = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(entry.address.split("%")[0])
            except ValueError:
                continue
            if not ip.is_loopback and not ip.is_link_local:
                found.append(str(ip))
    return sorted(set(found))


def probe_gpus(timeout: float = 10.0) -> tuple[list[dict[str, Any]], str | None]:
    """The GPUs and why the probe failed (None when it worked): NVML first, nvidia-smi as
    the fallback (agent/telemetry/_nvml.py). Neither present: [] and NVIDIA_SMI_ABSENT,
    "no NVIDIA GPU", which callers treat as a fact, not a failure."""
    found = _nvml.probe(timeout=min(timeout, 5.0))
    if found is not None and found[1] is None and found[0]:
        return found
    gpus, problem = smi_gpus(timeout)
    if problem is None or found is None or not found[1]:
        return gpus, problem
    # NVML is there but failing: that is the reason, whatever nvidia-smi says.
    return [], found[1] if problem == NVIDIA_SMI_ABSENT else f"{found[1]}; {problem}"


def smi_gpus(timeout: float = 10.0) -> tuple[list[dict[str, Any]], str | None]:
    """GPUs from nvidia-smi, and the reason it failed (None when it worked)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], NVIDIA_SMI_ABSENT
    try:
        result = subprocess.run(
            [smi, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi failed: {exc}"
    if result.returncode != 0:
        return [], f"nvidia-smi exited with {result.returncode}: {result.stderr.strip()[:200]}"
    return parse_gpus(result.stdout), None


def parse_gpus(stdout: str) -> list[dict[str, Any]]:
    """The GPUs of ``nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits``.

    A line without the six fields /info needs is skipped; ``utilizationPercent`` (for the
    telemetry, docs/decisions.md D61) is absent where nvidia-smi reports ``[N/A]`` (MIG
    instances, some drivers), never zero.
    """
    gpus = []
    for line in stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6:
            continue
        try:
            gpu: dict[str, Any] = {
                "index": int(parts[0]),
                "uuid": parts[1],
                "name": parts[2],
                "memoryTotalBytes": int(float(parts[3]) * 2**20),
                "memoryUsedBytes": int(float(parts[4]) * 2**20),
                "driverVersion": parts[5],
            }
        except ValueError:
            continue
        if len(parts) > 6:
            with contextlib.suppress(ValueError):
                gpu["utilizationPercent"] = float(parts[6])
        gpus.append(gpu)
    return gpus


def _default_probe() -> tuple[list[dict[str, Any]], str | None]:
    # Looked up at call time, so a test that replaces agent.telemetry._describe.probe_gpus also
    # replaces what every sampler built without an explicit probe runs.
    return probe_gpus()


class GpuSampler:
    """The last answer of a GPU probe, refreshed in a thread so the event loop never waits.

    :meth:`cached` is for readers that must not wait (the heartbeat): it answers the last
    result at once and, when that is older than ``max_age`` seconds, starts one refresh
    in the background. :meth:`current` waits for a result at most ``max_age`` old and
    :meth:`sample` for a fresh one (the memory measurement of a start needs that).

    The error it reports is None when the probe worked *or* nvidia-smi is simply not
    installed; only a probe that failed on a node that has nvidia-smi is an error. Each
    distinct error is logged once, not once per heartbeat.
    """

    def __init__(self, probe: GpuProbe | None = None, *, max_age: float = 5.0) -> None:
        self._probe = probe or _default_probe
        self._max_age = max_age
        self._gpus: list[dict[str, Any]] = []
        self._error: str | None = None
        self._absent = False
        self._at: float | None = None  # time.monotonic() of the last answer
        self._refresh: asyncio.Task[tuple[list[dict[str, Any]], str | None]] | None = None
        self._logged: str | None = None

    @property
    def absent(self) -> bool:
        """True when the last probe found no nvidia-smi on this node."""
        return self._absent

    def _fresh(self) -> bool:
        return self._at is not None and time.monotonic() - self._at < self._max_age

    def cached(self) -> tuple[list[dict[str, Any]], str | None]:
        """The last GPUs and probe error, at once; starts a refresh when they are stale."""
        if not self._fresh():
            self._start_refresh()
        return [dict(g) for g in self._gpus], self._error

    def _start_refresh(self) -> None:
        if self._refresh is not None and not self._refresh.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next async reader refreshes
        self._refresh = loop.create_task(self.sample(), name="gpu-probe")

    async def current(self) -> tuple[list[dict[str, Any]], str | None]:
        """GPUs and probe error at most ``max_age`` seconds old (waits for a probe if not)."""
        if self._fresh():
            return [dict(g) for g in self._gpus], self._error
        if self._refresh is not None and not self._refresh.done():
            # Shielded: a caller that gives up must not cancel the heartbeat's refresh.
            return await asyncio.shield(self._refresh)
        return await self.sample()

    async def sample(self) -> tuple[list[dict[str, Any]], str | None]:
        """Run the probe now, in a thread, and remember its answer."""
        try:
            gpus, error = await asyncio.to_thread(self._probe)
        except Exception as exc:  # an injected probe may raise; the real one does not
            gpus, error = [], f"the GPU probe failed: {exc}"
        self._store(gpus, error)
        return [dict(g) for g in self._gpus], self._error

    def _store(self, gpus: list[dict[str, Any]], error: str | None) -> None:
        self._at = time.monotonic()
        self._gpus = [dict(g) for g in gpus]
        self._absent = error == NVIDIA_SMI_ABSENT
        self._error = None if self._absent else error
        if error != self._logged:
            if self._absent:
                log.info("nvidia-smi is not installed; this node reports no GPUs")
            elif error is not None:
                log.warning("GPU probe failed: %s", error)
            elif self._logged is not None:
                log.info("GPU probe works again: %d GPU(s)", len(self._gpus))
            self._logged = error

    def heartbeat(self) -> dict[str, Any]:
        """``gpus`` (and ``gpuProbeError`` when the probe failed) for a heartbeat, at once."""
        gpus, error = self.cached()
        out: dict[str, Any] = {"gpus": heartbeat_gpus(gpus)}
        if error is not None:
            out["gpuProbeError"] = error
        return out

    async def close(self) -> None:
        """Cancel a refresh in flight (its thread finishes on its own)."""
        if self._refresh is not None and not self._refresh.done():
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh
        self._refresh = None


def heartbeat_gpus(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-GPU fields a heartbeat carries, from a probe's answer."""
    return [{k: g.get(k) for k in HEARTBEAT_GPU_FIELDS} for g in gpus]


def memory_used_by_uuid(gpus: list[dict[str, Any]]) -> dict[str, int]:
    """memory.used in bytes of each GPU of a probe's answer, by UUID."""
    out: dict[str, int] = {}
    for gpu in gpus:
        uuid, used = gpu.get("uuid"), gpu.get("memoryUsedBytes")
        if isinstance(uuid, str) and isinstance(used, int) and not isinstance(used, bool):
            out[uuid] = used
    return out


def group_rss(leader: int) -> tuple[int, int]:
    """RSS in bytes summed over process group ``leader`` and its descendants, and their count.

    An engine leads its own group, so the group id is its pid; a helper it forked that
    outlived its parent stays in the group, which is why the group is scanned and not
    only the process tree. Descendants are added for platforms where getpgid of a
    process in another session is refused. Processes come and go while this runs: one
    that vanished or cannot be read is skipped.
    """
    members: set[int] = set()
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(leader)
        members.add(leader)
        members.update(child.pid for child in root.children(recursive=True))
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == leader:
                members.add(pid)
    total = count = 0
    for pid in sorted(members):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:  # NoSuchProcess (and ZombieProcess), AccessDenied
            continue
        count += 1
    return total, count


def memory() -> dict[str, Any]:
    """The machine's RAM: total, available, used and percent used."""
    vm = psutil.virtual_memory()
    return {
        "totalBytes": vm.total,
        "availableBytes": vm.available,
        "usedBytes": vm.used,
        "percent": vm.percent,
    }


def disks(paths: list[Path]) -> list[dict[str, Any]]:
    """Size and free space of the volume each path lives on (its nearest existing parent)."""
    out = []
    for path in paths:
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            usage = psutil.disk_usage(str(probe))
        except OSError:
            continue
        out.append(
            {
                "path": str(path),
                "totalBytes": usage.total,
                "freeBytes": usage.free,
                "percent": usage.percent,
            }
        )
    return out


def describe(*, models_root: Path, state_directory: Path) -> dict[str, Any]:
    """The self-description /info carries (refreshed at each call)."""
    gpus, _ = probe_gpus()
    return {
        "os": platform.system(),
        "osVersion": platform.release(),
        "arch": platform.machine(),
        "hostname": platform.node(),
        "addresses": addresses(),
        "cpu": cpu_info(),
        "memory": memory(),
        "disks": disks([models_root, state_directory]),
        "gpus": gpus,
    }


def docker_reachable(endpoint: str, timeout: float = 3.0) -> str | None:
    """None when Docker answers /_ping, else why not (unix sockets and tcp://)."""
    import http.client

    try:
        if endpoint.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(endpoint.removeprefix("unix://"))
            conn = http.client.HTTPConnection("docker", timeout=timeout)
            conn.sock = sock
        elif endpoint.startswith("tcp://"):
            host, _, port = endpoint.removeprefix("tcp://").partition(":")
            conn = http.client.HTTPConnection(host, int(port or 2375), timeout=timeout)
        else:
            return f"{endpoint} cannot be probed from this platform"
        conn.request("GET", "/_ping")
        response = conn.getresponse()
        body = response.read(16)
        conn.close()
        if response.status != 200:
            return f"Docker at {endpoint} answered {response.status} {body!r}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"Docker at {endpoint} does not answer: {exc}"
    return None
