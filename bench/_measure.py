"""One measured point of bench/router.py: a path under wrk or a stream load, with the
CPU its processes spent (split out of bench/router.py, which runs the whole bench)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench import _load, _procs
from bench._paths import MODEL
from bench._tools import say

LABELS = {
    "direct": "stub, direct",
    "nginx": "nginx (1 hop)",
    "hops": "2 bare aiohttp hops",
    "mirbad": "MirbadLLM /v1",
    "litellm": "LiteLLM proxy",
}


@dataclass
class BenchPath:
    name: str
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    procs: list[psutil.Process] = field(default_factory=list)
    children: bool = False
    status: str = "ok"
    reason: str = ""

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def skip(self, reason: str) -> None:
        self.status, self.reason = "skipped", reason
        say(f"path {self.name} skipped: {reason}")

    def cpu(self) -> float:
        return _procs.cpu_seconds(self.procs, children=self.children)


def busy_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def measure_point(
    wrk: str,
    path: BenchPath,
    concurrency: int,
    *,
    scripts: dict[str, Path],
    stub: psutil.Process,
    aux: list[psutil.Process],
    settings: dict[str, Any],
) -> dict[str, Any]:
    point: dict[str, Any] = {"path": path.name, "concurrency": concurrency}
    script = scripts[path.name]
    try:
        _load.run_wrk(wrk, path.url, script, connections=concurrency, seconds=settings["warmup_s"])
        foreign_before = _procs.foreign_snapshot()
        path_before, stub_before = path.cpu(), _procs.cpu_seconds([stub])
        aux_before, busy_before = _procs.cpu_seconds(aux), busy_seconds()
        started = time.monotonic()
        result = _load.run_wrk(
            wrk, path.url, script, connections=concurrency, seconds=settings["duration_s"]
        )
        wall = time.monotonic() - started
        path_s, stub_s = path.cpu() - path_before, _procs.cpu_seconds([stub]) - stub_before
        aux_s, busy_s = _procs.cpu_seconds(aux) - aux_before, busy_seconds() - busy_before
        foreign = _procs.foreign_seconds(foreign_before)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        point["error"] = str(exc)[:300]
        say(f"  c={concurrency:<3} {path.label:<20} FAILED: {point['error']}")
        return point
    thousands = max(result.requests, 1) / 1000
    point["wrk"] = result.to_json()
    point["cpu_s"] = {
        "path": path_s,
        "stub": stub_s,
        "aux": aux_s,
        "wrk": result.wrk_cpu_s,
        "machine_busy": busy_s,
        "foreign": foreign,
    }
    point["cpu_per_1k"] = {"path_s": path_s / thousands, "stub_s": stub_s / thousands}
    if path.name == "mirbad":
        point["cpu_per_1k"]["aux_s"] = aux_s / thousands
    point["foreign_share"] = foreign / (wall * (os.cpu_count() or 1))
    errors = ", ".join(f"{k} {v}" for k, v in result.errors.items()) or "no errors"
    say(
        f"  c={concurrency:<3} {path.label:<20} {result.rps:9,.0f} req/s  p50 {result.p50_ms:7.2f} ms"
        f"  p99 {result.p99_ms:7.2f} ms  cpu/1k {point['cpu_per_1k']['path_s']:.3f} s  {errors}"
    )
    return point


def measure_throughput(
    path: BenchPath,
    concurrency: int,
    *,
    stub: psutil.Process,
    aux: list[psutil.Process],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """One streaming-throughput point: chunks/s and CPU s per 1,000 chunks of ``path``."""
    point: dict[str, Any] = {"path": path.name, "concurrency": concurrency}
    marks: dict[str, Any] = {}

    def mark(name: str) -> None:
        marks[name] = {
            "path": path.cpu(),
            "stub": _procs.cpu_seconds([stub]),
            "aux": _procs.cpu_seconds(aux),
            "busy": busy_seconds(),
            "at": time.monotonic(),
            "by_process": _procs.cpu_by_process(path.procs),
        }
        if name == "begin":
            marks["foreign"] = _procs.foreign_snapshot()
        else:
            marks["foreign_s"] = _procs.foreign_seconds(marks["foreign"])

    try:
        result = _load.run_stream_load(
            path.url,
            path.headers,
            _load.throughput_body(MODEL, settings["stream_chunks"]),
            concurrency=concurrency,
            warmup=settings["warmup_s"],
            seconds=settings["duration_s"],
            on_begin=lambda: mark("begin"),
            on_end=lambda: mark("end"),
            python=sys.executable,
        )
        if "begin" not in marks or "end" not in marks:
            raise RuntimeError("streamload printed no measured window")
    except (RuntimeError, OSError) as exc:
        point["error"] = str(exc)[:300]
        say(f"  c={concurrency:<3} {path.label:<20} FAILED: {point['error']}")
        return point
    begin, end = marks["begin"], marks["end"]
    path_s, stub_s = end["path"] - begin["path"], end["stub"] - begin["stub"]
    thousands = max(result["chunks"], 1) / 1000
    point["load"] = result
    point["cpu_s"] = {
        "path": path_s,
        "stub": stub_s,
        "aux": end["aux"] - begin["aux"],
        "machine_busy": end["busy"] - begin["busy"],
        "foreign": marks["foreign_s"],
    }
    point["cpu_per_1k"] = {"path_s": path_s / thousands, "stub_s": stub_s / thousands}
    point["cpu_per_1k"]["by_process"] = {
        name: (end["by_process"][name] - begin["by_process"].get(name, 0.0)) / thousands
        for name in end["by_process"]
    }
    if path.name == "mirbad":
        point["cpu_per_1k"]["aux_s"] = point["cpu_s"]["aux"] / thousands
    wall = max(end["at"] - begin["at"], 1e-9)
    point["foreign_share"] = marks["foreign_s"] / (wall * (os.cpu_count() or 1))
    errors = ", ".join(f"{k} {v}" for k, v in result["errors"].items()) or "no errors"
    say(
        f"  c={concurrency:<3} {path.label:<20} {result['chunks_per_s']:9,.0f} chunks/s"
        f"  cpu/1k chunks {point['cpu_per_1k']['path_s']:.3f} s"
        f" (stub {point['cpu_per_1k']['stub_s']:.3f} s)  {errors}"
    )
    return point


def added(points: list[dict[str, Any]]) -> None:
    direct = {p["concurrency"]: p for p in points if p["path"] == "direct" and "wrk" in p}
    for point in points:
        base = direct.get(point["concurrency"])
        if "wrk" not in point or base is None or point["path"] == "direct":
            continue
        point["added"] = {
            f"{q}_ms": point["wrk"][f"{q}_ms"] - base["wrk"][f"{q}_ms"]
            for q in ("p50", "p95", "p99")
        }
