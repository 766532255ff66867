"""bench/fleet.py's results as the markdown table of docs/performance.md."""

from __future__ import annotations

from typing import Any


def _mb(value: int) -> str:
    return f"{value / 2**20:,.0f} MiB"


def render(results: list[dict[str, Any]]) -> str:
    """The markdown table of docs/performance.md, one column per size."""
    sizes = [r["nodes"] for r in results]
    rows = [
        (
            "monitor CPU, steady state (cores)",
            lambda r: f"{r['steady']['monitorCpuCores']:.3f}",
            "< 0.5",
        ),
        (
            "web process CPU, steady state (cores)",
            lambda r: f"{r['steady']['webCpuCores']:.3f}",
            "—",
        ),
        (
            "status freshness p50 / p99 (s)",
            lambda r: f"{r['freshness']['p50']:.3f} / {r['freshness']['p99']:.3f}",
            "p99 < 5",
        ),
        (
            "every node Online after a restart (s)",
            lambda r: f"{r['restart']['allOnlineSeconds']:.1f}",
            "< 60",
        ),
        (
            "killed agent Offline after last contact (s)",
            lambda r: f"{r['kill']['offlineAfterLastContact']:.1f}",
            "15 to 20",
        ),
        *(
            (f"{label} p50 / p95 (ms; server CPU)", _timing_cell(key), target)
            for label, key, target in (
                ("GET /api/nodes", "apiNodes", "< 200"),
                ("Overview page", "overview", "< 150"),
                ("Nodes page", "nodesPage", "< 150"),
                ("placement suggestions", "suggest", "< 100"),
            )
        ),
        ("monitor memory", lambda r: _mb(r["steady"]["monitorRssBytes"]), "< 1 GiB"),
        ("web process memory", lambda r: _mb(r["steady"]["webRssBytes"]), "< 1 GiB"),
        ("models", lambda r: f"{r['models']:,}", "5,000 at 1,000"),
        (
            "nodes seen Offline while alive (steady, freshness, pages)",
            lambda r: f"{r['flaps']}",
            "0",
        ),
        (
            "starts refused: node seen Offline",
            lambda r: f"{r['grow']['startsRefusedNodeOffline']}",
            "0",
        ),
        (
            "enroll + start the new hollow agents (s)",
            lambda r: f"{r['grow']['enrollAndStartSeconds']:.1f}",
            "—",
        ),
        (
            "define the new models through /api (s)",
            lambda r: f"{r['grow']['modelsDefineSeconds']:.1f}",
            "—",
        ),
        ("start them, all Ready (s)", lambda r: f"{r['grow']['modelsReadySeconds']:.1f}", "—"),
    ]
    lines = [
        "| figure | " + " | ".join(f"{s:,} nodes" for s in sizes) + " | target at 1,000 |",
        "|---|" + "---|" * len(sizes) + "---|",
    ]
    for label, cell, target in rows:
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in results) + f" | {target} |")
    return "\n".join(lines)


def _timing_cell(key: str) -> Any:
    """The table cell of one timed URL (``timings()``'s ``key``)."""
    return lambda r: _pair(r["timings"][key])


def _pair(timing: dict[str, float]) -> str:
    """Wall p50 / p95, then the server's CPU p50 / p95 from Server-Timing."""
    wall = f"{timing['p50'] * 1000:.1f} / {timing['p95'] * 1000:.1f}"
    if "cpuP50" not in timing:  # a result written before Server-Timing
        return wall
    return f"{wall} (CPU {timing['cpuP50'] * 1000:.1f} / {timing['cpuP95'] * 1000:.1f})"
