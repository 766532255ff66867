"""The summary and the table of bench/engine_streams.py: the rounds pooled per
concurrency and path, the targets judged, the markdown printed and kept in the doc."""

from __future__ import annotations

import statistics
from typing import Any

from bench.tokenload import percentile

PATHS = ("direct", "v1")
LABELS = {"direct": "engine directly", "v1": "through /v1"}
TPS_TARGET = 0.01  # at most 1 % fewer tokens per second through /v1
TTFT_TARGET_MS = 2.0  # at most 2 ms more time to first token through /v1


def summarise(points: list[dict[str, Any]], concurrency: list[int]) -> list[dict[str, Any]]:
    """Per concurrency and path: the rounds pooled (tokens over seconds, every TTFT)."""
    rows: list[dict[str, Any]] = []
    for c in concurrency:
        row: dict[str, Any] = {"concurrency": c}
        for name in PATHS:
            mine = [p for p in points if p["concurrency"] == c and p["path"] == name and p["kept"]]
            row["timing"] = mine[0]["timing"]
            samples = [x for p in mine for x in p["ttft_ms"]]
            seconds = sum(p["seconds"] for p in mine)
            cpu: dict[str, float] = {}
            for p in mine:
                for k, v in p["cpu_s"].items():
                    cpu[k] = cpu.get(k, 0.0) + v
            row[name] = {
                "tokens_per_s": sum(p["tokens"] for p in mine) / seconds if seconds else 0.0,
                "rounds_tokens_per_s": [p["tokens_per_s"] for p in mine],
                "ttft_p50_ms": percentile(samples, 50),
                "ttft_p95_ms": percentile(samples, 95),
                "rounds_ttft_p50_ms": [p["ttft_p50_ms"] for p in mine],
                "ttft_count": len(samples),
                "errors": sum(p["errors_in_window"] for p in mine),
                # cores used: CPU seconds per second of window
                "cores": {k: v / seconds for k, v in cpu.items()} if seconds else {},
                "foreign_share": statistics.fmean(p["foreign_share"] for p in mine),
                "router_overhead_p50_ms": _median_of(mine, "router_overhead_p50_ms"),
                "router_queue_p50_ms": _median_of(mine, "router_queue_p50_ms"),
                "resent": sum(p["resent"] for p in mine),
                "router_queue_max_ms": max(
                    (
                        p["router_queue_max_ms"]
                        for p in mine
                        if p["router_queue_max_ms"] is not None
                    ),
                    default=None,
                ),
            }
        direct, v1 = row["direct"], row["v1"]
        tps_loss = 1 - v1["tokens_per_s"] / direct["tokens_per_s"] if direct["tokens_per_s"] else 1
        row["tps_loss"] = tps_loss
        row["ttft_p50_added_ms"] = v1["ttft_p50_ms"] - direct["ttft_p50_ms"]
        row["ttft_p95_added_ms"] = v1["ttft_p95_ms"] - direct["ttft_p95_ms"]
        # The same path's spread between its rounds: what the machine's noise alone does.
        row["direct_rounds_spread"] = _spread(direct["rounds_tokens_per_s"])
        row["tps_met"] = tps_loss <= TPS_TARGET
        row["ttft_met"] = row["ttft_p50_added_ms"] <= TTFT_TARGET_MS
        rows.append(row)
    return rows


def _median_of(points: list[dict[str, Any]], key: str) -> float | None:
    values = [p[key] for p in points if p.get(key) is not None]
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.fmean(values) if len(values) > 1 else 0.0


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"`{meta['command']}`, {meta['started']} to {meta['finished']} "
        f"({meta['seconds']:.0f} s), commit {meta['git']}; {meta['services']}; "
        f"{meta['settings']['max_tokens']} tokens per stream, {meta['settings']['slots']} slots, "
        f"{meta['settings']['threads']} engine thread(s), fair queue {meta['settings']['queue']}, "
        f"{meta['settings']['rounds']} rounds per path ({meta['settings']['order']}); "
        f"{sum(not p['kept'] for p in results['points'])} disturbed tries left out "
        f"(other processes above {meta['settings']['max_foreign']:.0%} of the CPU, each "
        "point measured again).",
        "",
        "| streams | tokens/s direct | tokens/s /v1 | /v1 vs direct | TTFT p50 direct | "
        "TTFT p50 /v1 | added | TTFT p95 direct | TTFT p95 /v1 | added | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        d, v = row["direct"], row["v1"]
        met = [
            "tokens/s " + ("met" if row["tps_met"] else "**not met**"),
            "TTFT " + ("met" if row["ttft_met"] else "**not met**"),
        ]
        lines.append(
            f"| {row['concurrency']} | {d['tokens_per_s']:,.0f} | {v['tokens_per_s']:,.0f} | "
            f"{-row['tps_loss']:+.1%} | {d['ttft_p50_ms']:.1f} ms | {v['ttft_p50_ms']:.1f} ms | "
            f"{row['ttft_p50_added_ms']:+.1f} ms | {d['ttft_p95_ms']:.1f} ms | "
            f"{v['ttft_p95_ms']:.1f} ms | {row['ttft_p95_added_ms']:+.1f} ms | {', '.join(met)} |"
        )
    lines += [
        "",
        "Rounds (tokens/s; TTFT p50 ms), in the order run, and the noise:",
        "",
        "| streams | warm-up, window | direct rounds | /v1 rounds | foreign CPU direct, /v1 | "
        "router's own time p50 (x-mirbad-overhead-ms) | queue wait p50, longest "
        "(x-mirbad-queue-ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        d, v = row["direct"], row["v1"]

        def rounds(side: dict[str, Any]) -> str:
            return ", ".join(
                f"{t:,.0f}; {f:.1f}"
                for t, f in zip(
                    side["rounds_tokens_per_s"], side["rounds_ttft_p50_ms"], strict=True
                )
            )

        overhead = v["router_overhead_p50_ms"]
        queue = v["router_queue_max_ms"]
        queue_p50 = v["router_queue_p50_ms"]
        when = row["timing"]
        lines.append(
            f"| {row['concurrency']} | {when['warmup']:g} s, {when['duration']:g} s | "
            f"{rounds(d)} | {rounds(v)} | "
            f"{d['foreign_share']:.0%}, {v['foreign_share']:.0%} | "
            f"{'-' if overhead is None else f'{overhead:.2f} ms'} | "
            f"{'-' if queue is None or queue_p50 is None else f'{queue_p50:.2f} ms, {queue:.1f} ms'} |"
        )
    groups = list(results["summary"][0]["direct"]["cores"]) if results["summary"] else []
    lines += [
        "",
        "CPU by process, in cores (CPU seconds per second of window; the machine has "
        f"{meta['machine']['cores']}):",
        "",
        "| streams | path | " + " | ".join(groups) + " | total | tokens per engine CPU s |",
        "|---|---|" + "---|" * (len(groups) + 2),
    ]
    for row in results["summary"]:
        for name in PATHS:
            cores = row[name]["cores"]
            engine = cores.get("engine")
            per_cpu = f"{row[name]['tokens_per_s'] / engine:,.0f}" if engine else "-"
            lines.append(
                f"| {row['concurrency']} | {LABELS[name]} | "
                + " | ".join(f"{cores.get(g, 0.0):.2f}" for g in groups)
                + f" | {sum(cores.values()):.2f} | {per_cpu} |"
            )
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------
