"""Side-by-side overhead of MirbadLLM's /v1 against reference proxies, in one run.

    .venv/bin/python bench/router.py            # full run (about 9 minutes on 2 cores)
    .venv/bin/python bench/router.py --quick    # smoke run: c=1 and c=64, 3 s per point

One stub engine (bench/stub_engine.py) is launched by a real MirbadLLM stack
(``mirbad_site.launcher up`` on free ports with its own data directory under /tmp), as
the local node's ``llama.cpp`` executable, so path 4 is the product path. Every other
path targets the port of that same process:

1. direct: the stub itself;
2. nginx: Debian's nginx as a plain reverse proxy (one worker, keep-alive upstream);
3. hops: two bare aiohttp proxies in a chain (bench/hop.py), our runtime's floor;
4. mirbad: /v1 through the master's router and the agent's proxy (mTLS), with a key;
5. litellm: LiteLLM's proxy (its own venv, one worker, no database).

Non-streamed load is wrk (one Lua script per path: body, headers, percentiles); time to
first streamed chunk is a sequential aiohttp client; streaming throughput is
bench/streamload.py (concurrent long streams of chunks sent back to back, chunks counted
as they arrive). CPU seconds per 1,000 requests (or chunks) are read with psutil from
the processes of each path before and after each point.
Results are printed, written as JSON to bench/results/ and into docs/performance.md
between its markers. See docs/performance.md for the method.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    # Run as a script: bench/ is sys.path[0]; the repository root is what we import from.
    sys.path[0] = str(ROOT)

import psutil  # noqa: E402

from bench import _load, _procs, _report, _tools  # noqa: E402
from bench._measure import (  # noqa: E402
    BenchPath,
    added,
    measure_point,
    measure_throughput,
)
from bench._paths import (  # noqa: E402
    LITELLM_KEY,
    MODEL,
    MirbadStack,
    start_hops,
    start_litellm,
    start_nginx,
)
from bench._tools import loud, say  # noqa: E402

# The second stream measurement spaces the stub's chunks like a fast engine (200 tokens/s):
# back to back, the first chunk competes for the two cores with the other 17.
PACE_MS = 5.0
PATH_ORDER = ("direct", "nginx", "hops", "mirbad", "litellm")
PARTS = ("wrk", "streams", "throughput")
DOC = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "bench" / "results"


def _stack_env() -> dict[str, str]:
    """MIRBAD_QUEUE from this environment, for a run with the fair queue off."""
    return {k: os.environ[k] for k in ("MIRBAD_QUEUE",) if k in os.environ}


# -- facts about the machine ------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    cpu, vm = platform.processor() or "?", False
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("?", "", platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and " hypervisor" in line:
                vm = True
    os_name = platform.system()
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": psutil.virtual_memory().total / 2**30,
        "os": os_name,
        "kernel": platform.release(),
        "vm": vm,
    }


def versions(
    nginx: str | None, wrk: str | None, litellm_venv: Path | None
) -> dict[str, str | None]:
    out: dict[str, str | None] = {"Python": platform.python_version()}
    out["nginx"] = _tools.version_of([nginx, "-v"], r"nginx/(\S+)") if nginx else None
    out["wrk"] = _tools.version_of([wrk, "-v"], r"wrk (\S+)") if wrk else None
    out["LiteLLM"] = _tools.litellm_version(litellm_venv) if litellm_venv else None
    for dist in ("aiohttp", "uvicorn", "uvloop", "httptools", "Django"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def git_facts() -> dict[str, Any]:
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "--no-optional-locks", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )

    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        head = git("rev-parse", "HEAD").stdout.strip()
        dirty = git("diff", "--quiet", "HEAD", "--", "router", "agent", "mirbad_site").returncode
        return {"commit": head or None, "dirty": dirty == 1}
    return {"commit": None, "dirty": None}


def quiet_check(seconds: float = 2.0) -> float:
    """The share of the machine's CPU that other processes used over a short pause."""
    before = _procs.foreign_snapshot()
    time.sleep(seconds)
    return _procs.foreign_seconds(before) / (seconds * (os.cpu_count() or 1))


# -- the run ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/router.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: c=1 and c=64, 3 s per point, 1 s warm-up, 50 streams",
    )
    parser.add_argument("--duration", type=float, help="seconds per point (default 8; quick 3)")
    parser.add_argument(
        "--warmup", type=float, help="warm-up seconds per point (default 2; quick 1)"
    )
    parser.add_argument("--concurrency", help="comma-separated (default 1,16,64,256; quick 1,64)")
    parser.add_argument(
        "--streams", type=int, help="sequential streams per path (default 200; quick 50)"
    )
    parser.add_argument(
        "--stream-chunks",
        type=int,
        default=_load.THROUGHPUT_CHUNKS,
        help=f"chunks per stream of the throughput point (default {_load.THROUGHPUT_CHUNKS})",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated subset of wrk (non-streamed load), streams (time to first "
        "chunk), throughput (concurrent long streams); default all",
    )
    parser.add_argument(
        "--paths",
        default=",".join(PATH_ORDER),
        help=f"comma-separated subset of {','.join(PATH_ORDER)} (direct is always run)",
    )
    parser.add_argument(
        "--hop-loop",
        choices=("asyncio", "uvloop"),
        default="uvloop",
        help="event loop of the two bare hops (default uvloop, as uvicorn and the agent)",
    )
    parser.add_argument(
        "--external-services",
        action="store_true",
        help="give the stack MIRBAD_DATABASE_URL/MIRBAD_REDIS_URL from the "
        "environment (default: embedded SQLite and Redis)",
    )
    parser.add_argument(
        "--litellm-venv",
        type=Path,
        default=_tools.default_litellm_venv(),
        help="LiteLLM's virtualenv (default ~/.cache/mirbad/bench-litellm)",
    )
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/performance.md")
    parser.add_argument(
        "--json", type=Path, help="where the raw JSON goes (default bench/results/)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory and its logs")
    args = parser.parse_args(argv)
    args.duration = args.duration or (3.0 if args.quick else 8.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    text = args.concurrency or ("1,64" if args.quick else "1,16,64,256")
    args.concurrency = [int(c) for c in text.split(",") if c.strip()]
    if not args.concurrency or any(c < 1 or c > 1024 for c in args.concurrency):
        parser.error("--concurrency: give values between 1 and 1024")
    args.streams = args.streams or (50 if args.quick else 200)
    if not 1 <= args.streams <= 5000 or not 1 <= args.duration <= 120 or args.warmup > 60:
        parser.error("--streams 1-5000, --duration 1-120 s, --warmup up to 60 s")
    if not 1 <= args.stream_chunks <= 100_000:
        parser.error("--stream-chunks 1-100000")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: a subset of {','.join(PARTS)}")
    args.parts = [p for p in PARTS if p in parts]
    wanted = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PATH_ORDER))
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}")
    args.paths = [p for p in PATH_ORDER if p in wanted or p == "direct"]
    return args


def run(args: argparse.Namespace, procs: _procs.Processes, work: Path) -> dict[str, Any]:
    started = dt.datetime.now(dt.UTC)
    notes: list[str] = []
    tools = _tools.ensure_debian(
        {
            **({"wrk": "wrk"} if "wrk" in args.parts else {}),
            **({"nginx": "nginx"} if "nginx" in args.paths else {}),
        }
    )
    wrk = tools.get("wrk")
    if wrk is None and "wrk" in args.parts:
        raise RuntimeError("wrk is not installed and could not be installed (apt-get install wrk)")
    paths = {name: BenchPath(name) for name in args.paths}
    litellm_exe: Path | None = None
    if "litellm" in paths:
        try:
            litellm_exe = _tools.ensure_litellm(args.litellm_venv)
        except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
            paths["litellm"].skip(f"installing {_tools.LITELLM_REQUIREMENT} failed: {exc}")
    if "nginx" in paths and tools.get("nginx") is None:
        paths["nginx"].skip("nginx is not installed and could not be installed")

    stack = MirbadStack(procs, work / "var", external=args.external_services, env=_stack_env())
    stack.prepare()
    try:
        return _run_with_stack(args, procs, work, stack, paths, tools, litellm_exe, started, notes)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup
        say("stopping the MirbadLLM stack")
        stack.stop()


def _run_with_stack(
    args: argparse.Namespace,
    procs: _procs.Processes,
    work: Path,
    stack: MirbadStack,
    paths: dict[str, BenchPath],
    tools: dict[str, str | None],
    litellm_exe: Path | None,
    started: dt.datetime,
    notes: list[str],
) -> dict[str, Any]:
    stack.start()
    instance = stack.start_model()
    stub_port, stub = instance["port"], psutil.Process(instance["pid"])
    say(f"stub engine Ready on port {stub_port} (pid {stub.pid}), launched by the agent")
    aux = []
    for name in ("monitor", "worker", "enroll"):
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            aux.append(psutil.Process(stack.pid(name)))
    with contextlib.suppress(psutil.Error):
        # The embedded Redis has no pid file: it is the launcher's child redis-server.
        assert stack.child is not None
        aux += [k for k in psutil.Process(stack.child.pid).children() if "redis" in k.name()]
    wrk = str(tools.get("wrk") or "wrk")
    chat = _load.CHAT_PATH
    paths["direct"].url = f"http://127.0.0.1:{stub_port}{chat}"
    key_note = "no key"
    if "mirbad" in paths:
        key, key_note, _limits = stack.create_key()
        if _limits is None:
            notes.append(
                f"The MirbadLLM /v1 key has {key_note}: the limit code path was not measured."
            )
        p = paths["mirbad"]
        p.url, p.headers = f"{stack.url}{chat}", {"Authorization": f"Bearer {key}"}
        p.procs = [psutil.Process(stack.pid("web")), psutil.Process(stack.pid("agent"))]
    if "nginx" in paths and paths["nginx"].status == "ok":
        try:
            port, master = start_nginx(procs, str(tools["nginx"]), work, stub_port)
            p = paths["nginx"]
            p.url, p.procs, p.children = f"http://127.0.0.1:{port}{chat}", [master], True
        except RuntimeError as exc:
            paths["nginx"].skip(str(exc))
    if "hops" in paths:
        try:
            port, hop_procs = start_hops(procs, stub_port, args.hop_loop)
            paths["hops"].url, paths["hops"].procs = f"http://127.0.0.1:{port}{chat}", hop_procs
        except RuntimeError as exc:
            paths["hops"].skip(str(exc))
    if "litellm" in paths and paths["litellm"].status == "ok" and litellm_exe is not None:
        try:
            say("starting LiteLLM (one worker, no database)")
            port, proc = start_litellm(procs, litellm_exe, work, stub_port)
            p = paths["litellm"]
            p.url, p.procs, p.children = f"http://127.0.0.1:{port}{chat}", [proc], True
            p.headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
        except RuntimeError as exc:
            paths["litellm"].skip(str(exc))

    for path in paths.values():
        if path.status != "ok":
            continue
        problem = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            problem = _load.check_path(path.url, path.headers, model=MODEL)
            if problem is None:
                break
            time.sleep(1.0)
        if problem is not None:
            if path.name == "direct":
                raise RuntimeError(f"the stub does not answer as expected: {problem}")
            path.skip(problem)
        else:
            say(f"path {path.name}: {path.url} answers (plain and streamed)")

    scripts = {
        name: _load.write_lua(
            work / f"{name}.lua", body=_load.chat_body(MODEL, stream=False), headers=path.headers
        )
        for name, path in paths.items()
    }
    live = [p for p in paths.values() if p.status == "ok"]
    background = quiet_check()
    if background > 0.10:
        loud(f"other processes use {background:.0%} of the machine's CPU: numbers will be noisy")
        notes.append(f"Other processes used {background:.0%} of the CPU just before the run.")
    settings = {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "stream_chunks": args.stream_chunks,
    }
    points: list[dict[str, Any]] = []
    for concurrency in args.concurrency if "wrk" in args.parts else []:
        say(f"concurrency {concurrency}")
        for path in live:
            points.append(
                measure_point(
                    wrk,
                    path,
                    concurrency,
                    scripts=scripts,
                    stub=stub,
                    aux=aux,
                    settings=settings,
                )
            )
    added(points)
    if "streams" in args.parts:
        say(f"streams: {args.streams} sequential streamed requests per path")
    streams: dict[str, Any] = {}
    paced: dict[str, Any] = {}
    # Paced streams take 16 x 5 ms each: a quarter as many keeps the run short.
    rounds = (
        ("back to back", streams, None, args.streams),
        (f"{PACE_MS:g} ms apart", paced, PACE_MS, max(20, args.streams // 4)),
    )
    for label, into, chunk_ms, count in rounds if "streams" in args.parts else ():
        for path in live:
            result = _load.run_streams(
                path.url, path.headers, model=MODEL, count=count, chunk_ms=chunk_ms
            )
            into[path.name] = result.to_json()
            say(
                f"  {path.label:<20} chunks {label}: first chunk p50 {result.ttfc_p50_ms:6.2f} ms"
                f"  p95 {result.ttfc_p95_ms:6.2f} ms  failures {result.failures}"
            )
    throughput: list[dict[str, Any]] = []
    for concurrency in args.concurrency if "throughput" in args.parts else []:
        say(
            f"streaming throughput, {concurrency} concurrent streams of {args.stream_chunks} chunks"
        )
        for path in live:
            throughput.append(
                measure_throughput(path, concurrency, stub=stub, aux=aux, settings=settings)
            )
    results: dict[str, Any] = {
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "quick": args.quick,
            "command": " ".join(shlex.quote(a) for a in ["bench/router.py", *sys.argv[1:]]),
            "settings": {
                **settings,
                "concurrency": args.concurrency,
                "streams": args.streams,
                "parts": args.parts,
                "hop_loop": args.hop_loop,
                "wrk_threads": "1 at c=1, else 2",
                "nginx_workers": 1,
                "litellm_workers": 1,
            },
            "stream_tokens": _load.STREAM_TOKENS,
            "stream_pace_ms": PACE_MS,
            "machine": machine_facts(),
            "versions": versions(
                tools.get("nginx"), tools.get("wrk"), args.litellm_venv if litellm_exe else None
            ),
            "git": git_facts(),
            "stack": {"services": stack.services, "limits": key_note},
            "background_cpu_share": background,
        },
        "paths": {
            name: {"label": p.label, "status": p.status, "reason": p.reason, "url": p.url}
            for name, p in paths.items()
        },
        "points": points,
        "streams": streams,
        "streams_paced": paced,
        "throughput": throughput,
        "notes": notes,
    }
    results["targets"] = _report.targets(results)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, results = _report.run_cleanly(
        lambda procs, work: run(args, procs, work),
        prefix="mirbad-bench-",
        keep=args.keep,
        stack_logs="var/logs",
    )
    if results is None:
        return code
    quick = "-quick" if args.quick else ""
    target = args.json or RESULTS / f"router-{_report.stamp(results)}{quick}.json"
    doc = None if args.no_doc else DOC
    _report.publish(results, target, _report.render, doc=doc, marks=_report.ROUTER_MARKS)
    return code


if __name__ == "__main__":
    sys.exit(main())
