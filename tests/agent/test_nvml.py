"""GPUs through NVML, bounded by a timeout, with nvidia-smi as the fallback.

No GPU here: a stand-in ``pynvml`` module (the external binding, not our code) answers
as a driver would, hangs as a wedged one does, or is missing; the fallback runs a
recorded ``nvidia-smi`` stand-in script put first on PATH.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.telemetry import _nvml
from agent.telemetry._describe import NVIDIA_SMI_ABSENT, probe_gpus

G0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
G1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(*, init_error: int | None = None, hang: threading.Event | None = None,
                no_utilisation: bool = False) -> types.ModuleType:  # fmt: skip
    """A pynvml that knows two GPUs (an H100 and an L4), as the binding's calls answer."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    nv.NVML_ERROR_LIBRARY_NOT_FOUND = 12  # type: ignore[attr-defined]
    nv.NVML_ERROR_DRIVER_NOT_LOADED = 9  # type: ignore[attr-defined]
    nv.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    gpus = [
        {"uuid": G0.encode(), "name": b"NVIDIA H100 80GB HBM3", "total": 80 * 2**30,
         "used": 30 * 2**30, "util": 71, "temp": 64, "mw": 312_500,
         "procs": [types.SimpleNamespace(pid=4242, usedGpuMemory=29 * 2**30),
                   types.SimpleNamespace(pid=99, usedGpuMemory=None)]},
        {"uuid": G1, "name": "NVIDIA L4", "total": 24 * 2**30, "used": 2**30, "util": 0,
         "temp": 40, "mw": 16_000, "procs": []},
    ]  # fmt: skip

    def init() -> None:
        if init_error is not None:
            raise NVMLError(init_error)

    def count() -> int:
        if hang is not None:
            hang.wait(30)
        return len(gpus)

    def utilisation(h: dict[str, Any]) -> Any:
        if no_utilisation and h["name"] == "NVIDIA L4":
            raise NVMLError(3)  # NOT_SUPPORTED, as on a MIG instance
        return types.SimpleNamespace(gpu=h["util"], memory=0)

    nv.nvmlInit = init  # type: ignore[attr-defined]
    nv.nvmlSystemGetDriverVersion = lambda: b"550.54.15"  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = count  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUUID = lambda h: h["uuid"]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetName = lambda h: h["name"]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        total=h["total"], used=h["used"], free=h["total"] - h["used"]
    )
    nv.nvmlDeviceGetUtilizationRates = utilisation  # type: ignore[attr-defined]
    nv.nvmlDeviceGetTemperature = lambda h, sensor: h["temp"]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetPowerUsage = lambda h: h["mw"]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: h["procs"]  # type: ignore[attr-defined]
    return nv


@pytest.fixture(autouse=True)
def _fresh_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_nvml, "_initialised", False)
    monkeypatch.setattr(_nvml, "_stuck", None)
    yield


@pytest.fixture
def no_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))


# What `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,driver_version,
# utilization.gpu --format=csv,noheader,nounits` printed on an A100 box.
RECORDED_SMI = (
    "0, GPU-5c5c5c5c-aaaa-bbbb-cccc-dddddddddddd, NVIDIA A100-SXM4-40GB, 40960, 1234, "
    "535.104.05, 12\n"
)


@pytest.fixture
def recorded_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{RECORDED_SMI}EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return script


def test_nvml_figures_for_every_gpu(monkeypatch: pytest.MonkeyPatch, no_smi: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    gpus, problem = probe_gpus()
    assert problem is None
    h100, l4 = gpus
    assert h100 == {
        "index": 0, "uuid": G0, "name": "NVIDIA H100 80GB HBM3",
        "memoryTotalBytes": 80 * 2**30, "memoryUsedBytes": 30 * 2**30,
        "memoryFreeBytes": 50 * 2**30, "driverVersion": "550.54.15", "source": "nvml",
        "utilizationPercent": 71.0, "temperatureC": 64.0, "powerWatts": 312.5,
        "processes": [{"pid": 4242, "memoryUsedBytes": 29 * 2**30}],
    }  # fmt: skip
    assert l4["uuid"] == G1 and l4["utilizationPercent"] == 0.0 and l4["processes"] == []


def test_a_reading_a_gpu_does_not_support_is_absent_not_zero(
    monkeypatch: pytest.MonkeyPatch, no_smi: None
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(no_utilisation=True))
    gpus, problem = probe_gpus()
    assert problem is None and "utilizationPercent" not in gpus[1]
    assert gpus[0]["utilizationPercent"] == 71.0


def test_without_the_nvml_library_nvidia_smi_is_the_fallback(
    monkeypatch: pytest.MonkeyPatch, recorded_smi: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=12))
    gpus, problem = probe_gpus()
    assert problem is None
    assert [(g["uuid"], g["memoryTotalBytes"], g.get("utilizationPercent")) for g in gpus] == [
        ("GPU-5c5c5c5c-aaaa-bbbb-cccc-dddddddddddd", 40960 * 2**20, 12.0)
    ]


@pytest.mark.parametrize("init_error", [12, 9])
def test_no_library_or_no_driver_and_no_smi_is_no_gpu(
    monkeypatch: pytest.MonkeyPatch, no_smi: None, init_error: int
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=init_error))
    assert probe_gpus() == ([], NVIDIA_SMI_ABSENT)


def test_pynvml_not_installed_is_no_gpu(monkeypatch: pytest.MonkeyPatch, no_smi: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert probe_gpus() == ([], NVIDIA_SMI_ABSENT)


def test_a_failing_nvml_is_the_reason_even_without_smi(
    monkeypatch: pytest.MonkeyPatch, no_smi: None
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=999))
    gpus, problem = probe_gpus()
    assert gpus == [] and problem == "NVML failed: NVML error 999"


def test_a_failing_nvml_falls_back_to_a_working_smi(
    monkeypatch: pytest.MonkeyPatch, recorded_smi: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=999))
    gpus, problem = probe_gpus()
    assert problem is None and gpus[0]["name"] == "NVIDIA A100-SXM4-40GB"


def test_a_wedged_driver_is_bounded_and_does_not_pile_up(
    monkeypatch: pytest.MonkeyPatch, no_smi: None
) -> None:
    released = threading.Event()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(hang=released))
    import time

    started = time.monotonic()
    gpus, problem = _nvml.probe(timeout=0.3) or ([], None)
    assert gpus == [] and problem == "NVML did not answer within 0.3 s"
    assert time.monotonic() - started < 2
    # Still stuck: the next probe answers at once instead of queueing a second call.
    started = time.monotonic()
    assert _nvml.probe(timeout=0.3) == (
        [],
        "NVML has not answered for over 0.3 s (a wedged driver?)",
    )
    assert time.monotonic() - started < 0.2
    released.set()
    assert _nvml._stuck is not None
    assert _nvml._stuck.done.wait(5)  # the stuck call returns
    gpus, problem = _nvml.probe(timeout=2) or ([], "absent")
    assert problem is None and [g["uuid"] for g in gpus] == [G0, G1]
