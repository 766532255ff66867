"""deploy/gpu-check/check.py, the prepared GPU check (docs/gpu-check.md), kept runnable:
here against the stand-in pynvml of test_nvml and nvidia-smi stand-ins on PATH; on a
lent GPU machine against the real driver."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path
from types import ModuleType

import pytest
from test_nvml import G0, G1, fake_pynvml

from agent.telemetry import _nvml

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "gpu-check" / "check.py"
# What nvidia-smi prints for the stand-in's two GPUs (MiB; the same driver).
AGREEING = (
    f"0, {G0}, NVIDIA H100 80GB HBM3, 81920, 30720, 550.54.15, 71\n"
    f"1, {G1}, NVIDIA L4, 24576, 1024, 550.54.15, 0\n"
)


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, output: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture(autouse=True)
def stand_in_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvml, "_initialised", False)
    monkeypatch.setattr(_nvml, "_stuck", None)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setitem(sys.modules, "torch", None)  # the allocation check needs a real GPU


def test_the_check_passes_where_nvml_and_nvidia_smi_agree(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    smi(monkeypatch, tmp_path, AGREEING)
    out = tmp_path / "gpu-check.json"
    assert load().main(["--out", str(out), "--probes", "3"]) == 0
    report = json.loads(out.read_text())
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    assert [g["uuid"] for g in report["nvml"]] == [G0, G1]


def test_the_check_fails_where_they_disagree(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    smi(monkeypatch, tmp_path, AGREEING.replace("NVIDIA L4", "NVIDIA L40S"))
    out = tmp_path / "gpu-check.json"
    assert load().main(["--out", str(out), "--probes", "3"]) == 1
    failed = [c["check"] for c in json.loads(out.read_text())["checks"] if not c["ok"]]
    assert failed == [f"{G1}: name, driver and total memory agree"]
