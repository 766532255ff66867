"""What the agent tells the master about its machine (self-description).

Static facts (OS, CPU, addresses, GPUs, engines) go into ``/info``; memory and
disk change, so they are sampled again for every heartbeat. GPUs are read with
``nvidia-smi`` when it exists; a probe that fails is a health reason only on a
node configured to have GPUs (``GpusExpected``).
"""

from __future__ import annotations

import ipaddress
import logging
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger("mirbad.agent.describe")

# The instruction-set features engines care about when picking a build.
CPU_FEATURES = ("sse4_2", "avx", "avx2", "avx512f", "avx512_bf16", "fma", "f16c", "amx_tile")


def cpu_info() -> dict[str, Any]:
    model, flags = platform.processor() or "", set()
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
    """GPUs from nvidia-smi, and the reason the probe failed (None when it worked or is absent)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi is not installed"
    try:
        result = subprocess.run(
            [smi, "--query-gpu=index,uuid,name,memory.total,memory.used,driver_version",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi failed: {exc}"
    if result.returncode != 0:
        return [], f"nvidia-smi exited with {result.returncode}: {result.stderr.strip()[:200]}"
    gpus = []
    for line in result.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6:
            continue
        try:
            gpus.append(
                {
                    "index": int(parts[0]),
                    "uuid": parts[1],
                    "name": parts[2],
                    "memoryTotalBytes": int(float(parts[3]) * 2**20),
                    "memoryUsedBytes": int(float(parts[4]) * 2**20),
                    "driverVersion": parts[5],
                }
            )
        except ValueError:
            continue
    return gpus, None


def memory() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "totalBytes": vm.total,
        "availableBytes": vm.available,
        "usedBytes": vm.used,
        "percent": vm.percent,
    }


def disks(paths: list[Path]) -> list[dict[str, Any]]:
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
