"""The benchmark's markdown: results tables, the targets, and the block in docs/performance.md.

Also the frame bench/router.py and bench/fair_queue.py share around a run: ``run_cleanly``
(a work directory, Ctrl-C and SIGTERM, every process stopped) and ``publish`` (the raw
JSON, the markdown block printed and put between the bench's markers in the doc).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _procs
from bench._tools import say

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- bench-router:results:begin (written by bench/router.py; edits here are replaced) -->"
END = "<!-- bench-router:results:end -->"

# The targets of the issue, against the two bare aiohttp hops and the direct call.
TARGET_P50_RATIO = 1.3
TARGET_TTFC_ADDED_MS = 1.3
TARGET_RPS_SHARE = 0.70
# Streaming throughput (issue 12): MirbadLLM's CPU per chunk against the two bare hops'.
TARGET_CHUNK_CPU_RATIO = 0.5


def _ms(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:,.{digits}f}"


def _point(results: dict[str, Any], path: str, concurrency: int) -> dict[str, Any] | None:
    for point in results["points"]:
        if point["path"] == path and point["concurrency"] == concurrency and "wrk" in point:
            return point
    return None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The three targets, each with measured, limit and pass (None: not measured)."""
    out: list[dict[str, Any]] = []
    mirbad1, hops1 = _point(results, "mirbad", 1), _point(results, "hops", 1)
    if mirbad1 and hops1:
        limit = TARGET_P50_RATIO * hops1["added"]["p50_ms"]
        measured = mirbad1["added"]["p50_ms"]
        out.append(
            {
                "target": "added p50 at c=1 ≤ 1.3 x two bare hops'",
                "measured": f"{measured:.2f} ms",
                "limit": f"{limit:.2f} ms (1.3 x {hops1['added']['p50_ms']:.2f})",
                "pass": measured <= limit,
            }
        )
    else:
        out.append({"target": "added p50 at c=1 ≤ 1.3 x two bare hops'", "pass": None})
    out.append(_ttfc_target(results.get("streams", {}), "back to back"))
    pace = results["meta"].get("stream_pace_ms")
    if results.get("streams_paced"):
        out.append(_ttfc_target(results["streams_paced"], f"{pace:g} ms apart"))
    mirbad64, hops64 = _point(results, "mirbad", 64), _point(results, "hops", 64)
    if mirbad64 and hops64 and hops64["wrk"]["rps"]:
        share = mirbad64["wrk"]["rps"] / hops64["wrk"]["rps"]
        out.append(
            {
                "target": "req/s at c=64 ≥ 70 % of two bare hops'",
                "measured": f"{mirbad64['wrk']['rps']:,.0f} req/s ({share:.0%})",
                "limit": f"{TARGET_RPS_SHARE * hops64['wrk']['rps']:,.0f} req/s",
                "pass": share >= TARGET_RPS_SHARE,
            }
        )
    else:
        out.append({"target": "req/s at c=64 ≥ 70 % of two bare hops'", "pass": None})
    out.extend(_throughput_targets(results))
    out.append(_never_above_hops(results))
    return out


def _throughput_point(
    results: dict[str, Any], path: str, concurrency: int
) -> dict[str, Any] | None:
    for point in results.get("throughput", []):
        if point["path"] == path and point["concurrency"] == concurrency and "load" in point:
            return point
    return None


def _throughput_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """CPU s per 1,000 chunks ≤ half the two bare hops', one row per concurrency."""
    out: list[dict[str, Any]] = []
    for c in sorted({p["concurrency"] for p in results.get("throughput", [])}):
        name = f"streaming, c={c}: CPU s / 1k chunks ≤ {TARGET_CHUNK_CPU_RATIO:g} x two bare hops'"
        mirbad, hops = (
            _throughput_point(results, "mirbad", c),
            _throughput_point(results, "hops", c),
        )
        if not (mirbad and hops) or mirbad["load"]["errors"] or hops["load"]["errors"]:
            out.append({"target": name, "pass": None})
            continue
        measured, reference = mirbad["cpu_per_1k"]["path_s"], hops["cpu_per_1k"]["path_s"]
        out.append(
            {
                "target": name,
                "measured": f"{measured:.3f} s ({measured / reference:.0%} of {reference:.3f} s)",
                "limit": f"{TARGET_CHUNK_CPU_RATIO * reference:.3f} s",
                "pass": measured <= TARGET_CHUNK_CPU_RATIO * reference,
            }
        )
    return out


def _never_above_hops(results: dict[str, Any]) -> dict[str, Any]:
    """/v1 at or below the two bare hops at every point of the run: added p50 and CPU per
    request (non-streamed), CPU per chunk (streaming), and at least their throughput."""
    name = "at or below two bare hops at every point (added p50, CPU, throughput)"
    worse: list[str] = []
    compared = 0
    for point in results["points"]:
        if point["path"] != "mirbad" or "wrk" not in point:
            continue
        hops = _point(results, "hops", point["concurrency"])
        if hops is None or "added" not in point or "added" not in hops:
            continue
        compared += 1
        c = point["concurrency"]
        if point["added"]["p50_ms"] > hops["added"]["p50_ms"]:
            worse.append(f"c={c} added p50")
        if point["cpu_per_1k"]["path_s"] > hops["cpu_per_1k"]["path_s"]:
            worse.append(f"c={c} CPU/request")
        if point["wrk"]["rps"] < hops["wrk"]["rps"]:
            worse.append(f"c={c} req/s")
    for point in results.get("throughput", []):
        if point["path"] != "mirbad" or "load" not in point:
            continue
        hops = _throughput_point(results, "hops", point["concurrency"])
        if hops is None:
            continue
        compared += 1
        c = point["concurrency"]
        if point["cpu_per_1k"]["path_s"] > hops["cpu_per_1k"]["path_s"]:
            worse.append(f"streaming c={c} CPU/chunk")
        if point["load"]["chunks_per_s"] < hops["load"]["chunks_per_s"]:
            worse.append(f"streaming c={c} chunks/s")
    if not compared:
        return {"target": name, "pass": None}
    return {
        "target": name,
        "measured": "above at " + ", ".join(worse) if worse else f"{compared} points, none above",
        "limit": "none above",
        "pass": not worse,
    }


def _stream_table(title: str, streams: dict[str, Any], paths: dict[str, Any]) -> list[str]:
    direct = streams.get("direct") or {}
    lines = [title, ""]
    lines.append(
        "| path | first chunk p50 ms | p95 ms | added p50 | added p95 | whole stream p50 ms "
        "| SSE events | failures |"
    )
    lines.append("|" + "---|" * 8)
    for name, s in streams.items():
        label = paths[name]["label"]
        if not s.get("count"):
            lines.append(f"| {label} | failed: {s.get('first_failure')} | | | | | | |")
            continue
        is_direct = name == "direct" or not direct.get("count")
        add50 = None if is_direct else s["ttfc_p50_ms"] - direct["ttfc_p50_ms"]
        add95 = None if is_direct else s["ttfc_p95_ms"] - direct["ttfc_p95_ms"]
        lines.append(
            f"| {label} | {_ms(s['ttfc_p50_ms'])} | {_ms(s['ttfc_p95_ms'])} | {_ms(add50)} "
            f"| {_ms(add95)} | {_ms(s['total_p50_ms'])} | {s['events_median']:g} "
            f"| {s['failures']} |"
        )
    lines.append("")
    return lines


def _ttfc_target(streams: dict[str, Any], how: str) -> dict[str, Any]:
    name = f"added time to first streamed chunk (p50) ≤ 1.3 ms, chunks {how}"
    mirbad_s, direct_s = streams.get("mirbad"), streams.get("direct")
    if not (mirbad_s and direct_s and mirbad_s.get("count") and direct_s.get("count")):
        return {"target": name, "pass": None}
    added = mirbad_s["ttfc_p50_ms"] - direct_s["ttfc_p50_ms"]
    hops_s = streams.get("hops") or {}
    reference = ""
    if hops_s.get("count"):
        reference = f" (two bare hops: {hops_s['ttfc_p50_ms'] - direct_s['ttfc_p50_ms']:.2f} ms)"
    return {
        "target": name,
        "measured": f"{added:.2f} ms{reference}",
        "limit": f"{TARGET_TTFC_ADDED_MS:.2f} ms",
        "pass": added <= TARGET_TTFC_ADDED_MS,
    }


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    paths = results["paths"]
    lines: list[str] = []
    if meta["quick"]:
        lines.append(
            f"**Quick smoke run** of {meta['finished']} (`{meta['command']}`): it proves every "
            "path works; its short points are not the measurement."
        )
    else:
        lines.append(f"Run of {meta['finished']}: `{meta['command']}`.")
    lines.append("")
    machine = meta["machine"]
    versions = meta["versions"]
    lines.append(
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']:.0f} GiB, "
        f"{machine['os']}, kernel {machine['kernel']}{', virtual machine' if machine['vm'] else ''}. "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
        + "."
    )
    lines.append(
        f"Settings: {meta['settings']['duration_s']:g} s per point after a "
        f"{meta['settings']['warmup_s']:g} s warm-up, concurrency "
        f"{', '.join(str(c) for c in meta['settings']['concurrency'])}, "
        f"{meta['settings']['streams']} sequential streams per path, bare hops on "
        f"{meta['settings']['hop_loop']}; MirbadLLM stack: {meta['stack']['services']}; "
        f"/v1 key: {meta['stack']['limits']}."
    )
    lines.append("")
    skipped = [f"**{p['label']}**: {p['reason']}" for p in paths.values() if p["status"] != "ok"]
    if skipped:
        lines.append("Paths that did not run: " + "; ".join(skipped) + ".")
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"> **Note:** {note}")
        lines.append("")

    lines.append("### Non-streamed requests (wrk, POST /v1/chat/completions)")
    lines.append("")
    lines.append(
        "| c | path | req/s | p50 ms | p95 ms | p99 ms | added p50 | added p95 | added p99 "
        "| CPU s / 1k (path) | CPU s / 1k (stub) | errors |"
    )
    lines.append("|" + "---|" * 12)
    for point in results["points"]:
        label = paths[point["path"]]["label"]
        if "wrk" not in point:
            lines.append(
                f"| {point['concurrency']} | {label} | failed: {point.get('error', '?')} "
                "| | | | | | | | | |"
            )
            continue
        w = point["wrk"]
        added = point.get("added")
        cpu = point["cpu_per_1k"]
        errors = ", ".join(f"{k} {v}" for k, v in w["errors"].items()) or "0"
        lines.append(
            f"| {point['concurrency']} | {label} | {_num(w['rps'])} | {_ms(w['p50_ms'])} "
            f"| {_ms(w['p95_ms'])} | {_ms(w['p99_ms'])} "
            f"| {_ms(added['p50_ms']) if added else '—'} | {_ms(added['p95_ms']) if added else '—'} "
            f"| {_ms(added['p99_ms']) if added else '—'} "
            f"| {_ms(cpu['path_s'], 3) if point['path'] != 'direct' else '—'} "
            f"| {_ms(cpu['stub_s'], 3)} | {errors} |"
        )
    lines.append("")
    streams = results.get("streams", {})
    tokens = results["meta"]["stream_tokens"]
    pace = results["meta"].get("stream_pace_ms")
    if streams:
        lines.extend(
            _stream_table(
                f"### Streamed requests (aiohttp client, sequential, {tokens} chunks + usage + "
                "[DONE], back to back)",
                streams,
                paths,
            )
        )
    if results.get("streams_paced"):
        lines.extend(
            _stream_table(
                f"### Streamed requests, chunks {pace:g} ms apart (a fast engine's token rate)",
                results["streams_paced"],
                paths,
            )
        )
    if streams:
        overhead = (streams.get("mirbad") or {}).get("overhead_header_p50_ms")
        if overhead is not None:
            lines.append(
                f"MirbadLLM's own `x-mirbad-overhead-ms` on those streams: p50 {overhead:.2f} ms."
            )
            lines.append("")
    lines.extend(_throughput_table(results, paths))
    aux = [
        p
        for p in results["points"]
        if p["path"] == "mirbad" and "wrk" in p and "aux_s" in p["cpu_per_1k"]
    ]
    if aux:
        lines.append(
            "MirbadLLM's other processes (Redis, monitor, Celery, enroll listener) used "
            + ", ".join(f"{p['cpu_per_1k']['aux_s']:.3f}" for p in aux)
            + " CPU s / 1k requests during its points ("
            + ", ".join(f"c={p['concurrency']}" for p in aux)
            + "); they are not in the path column."
        )
        lines.append("")
    busy = [p for p in results["points"] if p.get("foreign_share", 0) > 0.05]
    if busy:
        lines.append(
            "> **Warning:** other processes on the machine used CPU during "
            + ", ".join(
                f"{paths[p['path']]['label']} c={p['concurrency']} ({p['foreign_share']:.0%})"
                for p in busy
            )
            + "; those points are disturbed."
        )
        lines.append("")
    lines.append("### Targets (MirbadLLM /v1)")
    lines.append("")
    lines.append("| target | measured | limit | result |")
    lines.append("|---|---|---|---|")
    for t in results.get("targets", []):
        verdict = {True: "pass", False: "**FAIL**", None: "not measured"}[t["pass"]]
        lines.append(
            f"| {t['target']} | {t.get('measured', '—')} | {t.get('limit', '—')} | {verdict} |"
        )
    lines.append("")
    lines.append(f"Raw numbers: `{meta['json']}`.")
    return "\n".join(lines)


def _throughput_table(results: dict[str, Any], paths: dict[str, Any]) -> list[str]:
    points = results.get("throughput") or []
    if not points:
        return []
    chunks = results["meta"]["settings"].get("stream_chunks")
    lines = [
        f"### Streaming throughput (bench/streamload.py: concurrent streams of {chunks:,} "
        "chunks sent back to back, each stream restarted when it ends)",
        "",
        "| c | path | chunks/s | streams | CPU s / 1k chunks (path) | CPU s / 1k chunks (stub) "
        "| client CPU s | errors |",
        "|" + "---|" * 8,
    ]
    for point in points:
        label = paths[point["path"]]["label"]
        if "load" not in point:
            lines.append(
                f"| {point['concurrency']} | {label} | failed: {point.get('error', '?')} "
                "| | | | | |"
            )
            continue
        load, cpu = point["load"], point["cpu_per_1k"]
        errors = ", ".join(f"{k} {v}" for k, v in load["errors"].items()) or "0"
        lines.append(
            f"| {point['concurrency']} | {label} | {_num(load['chunks_per_s'])} "
            f"| {load['streams']:,} "
            f"| {_ms(cpu['path_s'], 4) if point['path'] != 'direct' else '—'} "
            f"| {_ms(cpu['stub_s'], 4)} | {load['client_cpu_s']:.1f} | {errors} |"
        )
    lines.append("")
    busy = [p for p in points if p.get("foreign_share", 0) > 0.05]
    if busy:
        lines.append(
            "> **Warning:** other processes on the machine used CPU during "
            + ", ".join(
                f"{paths[p['path']]['label']} c={p['concurrency']} ({p['foreign_share']:.0%})"
                for p in busy
            )
            + "; those streaming points are disturbed."
        )
        lines.append("")
    return lines


# -- the frame of a bench command ------------------------------------------------------


@dataclass(frozen=True)
class Marks:
    """Where a bench's block goes in its doc: between ``begin`` and ``end`` (matched on
    ``begin`` up to its " (" note), else appended under ``section``."""

    begin: str
    end: str
    section: str


ROUTER_MARKS = Marks(BEGIN, END, "## Results")


class Interrupted(Exception):
    """SIGTERM during a run: stopped as Ctrl-C is."""


def update_doc(doc: Path, block: str, marks: Marks = ROUTER_MARKS) -> None:
    """Replace what lies between the markers (or append a section with them)."""
    text = doc.read_text() if doc.exists() else "# Performance\n"
    new = f"{marks.begin}\n{block}\n{marks.end}"
    pattern = re.compile(
        re.escape(marks.begin.split(" (")[0]) + r".*?" + re.escape(marks.end), re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _m: new, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n{marks.section}\n\n{new}\n"
    doc.write_text(text)


def run_cleanly(
    run: Callable[[_procs.Processes, Path], dict[str, Any]],
    *,
    prefix: str,
    keep: bool,
    stack_logs: str,
) -> tuple[int, dict[str, Any] | None]:
    """(exit status, results) of ``run`` in a fresh work directory under /tmp.

    Ctrl-C and SIGTERM stop it (130), a RuntimeError fails it (1); whatever happens,
    every process it started is stopped, and the directory is removed unless ``keep``
    or the run failed (its logs, and the stacks' under ``stack_logs``, then stay)."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    procs = _procs.Processes(work / "logs")

    def on_term(signum: int, frame: Any) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    code = 0
    results: dict[str, Any] | None = None
    try:
        results = run(procs, work)
    except (KeyboardInterrupt, Interrupted):
        say("interrupted; stopping everything")
        code = 130
    except RuntimeError as exc:
        say(f"failed: {exc}")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        procs.stop_all()
        if keep or code == 1:
            say(
                f"work directory kept: {work} (logs in {work / 'logs'}, "
                f"stack logs in {work / stack_logs})"
            )
        else:
            shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return code, results


def stamp(results: dict[str, Any]) -> str:
    """The run's end time as it goes into a results file's name (2026-12-04T131500Z)."""
    return str(results["meta"]["finished"]).replace(":", "").replace("+0000", "Z")


def publish(
    results: dict[str, Any],
    target: Path,
    render: Callable[[dict[str, Any]], str],
    *,
    doc: Path | None,
    marks: Marks,
) -> None:
    """Write ``results`` as JSON to ``target`` (named in its meta, relative to the
    repository where it lies inside it), print ``render``'s markdown, and put it
    into ``doc`` between ``marks`` (None: the doc is left alone)."""
    with contextlib.suppress(ValueError):
        results["meta"]["json"] = str(target.resolve().relative_to(ROOT))
    results["meta"].setdefault("json", str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2) + "\n")
    block = render(results)
    print("\n" + block + "\n", flush=True)
    if doc is not None:
        update_doc(doc, block, marks)
        say(f"wrote {doc.relative_to(ROOT)} and {results['meta']['json']}")
    else:
        say(f"wrote {results['meta']['json']}")
