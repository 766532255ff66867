"""The agent's GPU readings checked on a real NVIDIA GPU (docs/gpu-check.md).

Runs the agent's own NVML probe (agent/telemetry/_nvml.py) and its nvidia-smi
fallback (agent/telemetry/_describe.py) side by side on the machine's GPUs, times
the probe, and, where PyTorch is there, allocates memory on the first GPU to see the
probe's used memory and its per-process figure follow. Prints one line per check
and writes everything to ``--out`` as JSON; exits 1 when a check fails.

Only the two telemetry modules are loaded (not the agent package, whose imports a
GPU machine may lack): stand-in package objects keep ``agent/__init__.py`` from
running. Needs Python 3.11+, psutil and nvidia-ml-py (``pynvml``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
MIB = 2**20


def load_telemetry() -> tuple[Any, Any]:
    """The agent's two GPU modules: through the package where its needs are installed,
    else through stand-in package objects (the package's own imports never run)."""
    try:
        from agent.telemetry import _describe, _nvml
    except ImportError:
        for name in [n for n in sys.modules if n == "agent" or n.startswith("agent.")]:
            del sys.modules[name]
        for name, folder in (
            ("agent", ROOT / "agent"),
            ("agent.telemetry", ROOT / "agent/telemetry"),
        ):
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
        from agent.telemetry import _describe, _nvml
    return _nvml, _describe


class Checks:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def check(self, name: str, ok: bool, detail: Any) -> None:
        self.results.append({"check": name, "ok": ok, "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(not r["ok"] for r in self.results)


def compare(checks: Checks, nvml: list[dict[str, Any]], smi: list[dict[str, Any]]) -> None:
    by_uuid = {g["uuid"]: g for g in smi}
    checks.check(
        "same GPUs from NVML and nvidia-smi",
        sorted(g["uuid"] for g in nvml) == sorted(by_uuid),
        {"nvml": [g["uuid"] for g in nvml], "nvidia-smi": sorted(by_uuid)},
    )
    for gpu in nvml:
        other = by_uuid.get(gpu["uuid"], {})
        total_gap = abs(int(gpu.get("memoryTotalBytes", 0)) - int(other.get("memoryTotalBytes", 0)))
        checks.check(
            f"{gpu['uuid']}: name, driver and total memory agree",
            gpu.get("name") == other.get("name")
            and gpu.get("driverVersion") == other.get("driverVersion")
            and total_gap <= MIB,  # nvidia-smi prints MiB
            {"nvml": {k: gpu.get(k) for k in ("name", "driverVersion", "memoryTotalBytes")},
             "nvidia-smi": {k: other.get(k) for k in ("name", "driverVersion", "memoryTotalBytes")}},
        )  # fmt: skip
        checks.check(
            f"{gpu['uuid']}: used + free = total (NVML)",
            "memoryFreeBytes" not in gpu
            or abs(gpu["memoryUsedBytes"] + gpu["memoryFreeBytes"] - gpu["memoryTotalBytes"])
            <= 64 * MIB,
            {k: gpu.get(k) for k in ("memoryUsedBytes", "memoryFreeBytes", "memoryTotalBytes")},
        )


def allocation(checks: Checks, nvml_probe: Any, uuid: str) -> dict[str, Any] | None:
    """4 GiB on the first GPU through PyTorch: the probe's used memory must follow."""
    try:
        import torch  # type: ignore[import-not-found]  # only on a GPU machine; absent is reported
    except ImportError:
        checks.check("allocation follows", True, "skipped: PyTorch is not installed here")
        return None
    if not torch.cuda.is_available():
        checks.check("allocation follows", False, "PyTorch sees no CUDA device")
        return None

    def used() -> tuple[int, list[dict[str, Any]]]:
        found, _problem = nvml_probe(timeout=5.0)
        gpu = next(g for g in found if g["uuid"] == uuid)
        return int(gpu["memoryUsedBytes"]), list(gpu.get("processes") or [])

    torch.cuda.init()
    before, _ = used()
    block = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    after, processes = used()
    mine = [p for p in processes if p.get("pid") == os.getpid()]
    del block
    torch.cuda.empty_cache()
    rise = after - before
    checks.check("used memory rises by the 4 GiB allocated", rise >= 4 * 2**30, {"riseBytes": rise})
    checks.check(
        "this process appears with at least 4 GiB (where the driver reports processes)",
        not processes or (bool(mine) and int(mine[0].get("memoryUsedBytes") or 0) >= 4 * 2**30),
        {"processes": processes[:8], "pid": os.getpid()},
    )
    return {"beforeBytes": before, "afterBytes": after, "processes": processes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args(argv)
    nvml_mod, describe = load_telemetry()
    checks = Checks()
    found = nvml_mod.probe(timeout=5.0)
    checks.check(
        "NVML is present",
        found is not None,
        "pynvml and the driver answered" if found else "absent",
    )
    if found is None:
        args.out.write_text(json.dumps({"checks": checks.results}, indent=2))
        return 1
    nvml_gpus, problem = found
    checks.check(
        "NVML lists GPUs",
        bool(nvml_gpus) and problem is None,
        {"problem": problem, "count": len(nvml_gpus)},
    )
    smi_gpus, smi_problem = describe.smi_gpus()
    checks.check(
        "nvidia-smi answers", smi_problem is None, smi_problem or f"{len(smi_gpus)} GPU(s)"
    )
    compare(checks, nvml_gpus, smi_gpus)
    chosen, chosen_problem = describe.probe_gpus()
    checks.check(
        "the agent's probe takes NVML's answer",
        chosen_problem is None and [g["uuid"] for g in chosen] == [g["uuid"] for g in nvml_gpus],
        {"problem": chosen_problem},
    )
    timings = []
    for _ in range(args.probes):
        started = time.perf_counter()
        nvml_mod.probe(timeout=5.0)
        timings.append((time.perf_counter() - started) * 1000)
    smi_timings = []
    for _ in range(5):
        started = time.perf_counter()
        describe.smi_gpus()
        smi_timings.append((time.perf_counter() - started) * 1000)
    timing = {
        "nvmlMs": {"p50": statistics.median(timings), "max": max(timings)},
        "nvidiaSmiMs": {"p50": statistics.median(smi_timings), "max": max(smi_timings)},
    }
    checks.check("an NVML probe is under 1 s", max(timings) < 1000, timing)
    alloc = allocation(checks, nvml_mod.probe, nvml_gpus[0]["uuid"]) if nvml_gpus else None
    args.out.write_text(
        json.dumps(
            {
                "checks": checks.results,
                "nvml": nvml_gpus,
                "nvidiaSmi": smi_gpus,
                "timing": timing,
                "allocation": alloc,
            },
            indent=2,
        )
    )
    print(f"{'FAILED' if checks.failed else 'all checks passed'}; details in {args.out}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
