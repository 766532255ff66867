"""The fair queue under load (issue 18): queue on against queue off, in one run.

    .venv/bin/python bench/fair_queue.py             # both runs, about 2.5 minutes on 2 cores
    .venv/bin/python bench/fair_queue.py --duration 5 --no-doc     # a smoke run

A real MirbadLLM stack (``mirbad_site.launcher up`` on free ports, its own data
directory under /tmp; embedded SQLite and Redis unless ``--external-services``) serves
one model with ``parallel: 4`` whose engine is bench/stub_engine.py with its slots on:
at most 4 completions at once, the rest wait inside it in arrival order, as
llama-server defers what its slots cannot take. Each completion is a stream of
``--chunks`` chunks ``--chunk-ms`` apart: its service time, the slot time.

Two keys of priority 0 send streamed chat completions over 64 client connections
(``--heavy-conns`` for the heavy key, the rest for the light key). Arrivals are open
loop, Poisson, from a fixed seed, the same in both runs: the heavy key at ``--load``
times the engine's capacity (slots / slot time), the light key at a tenth of the
heavy key's rate, for ``--duration`` seconds; then the run waits for every answer
(bounded). The stack runs twice, with the queue on and with ``MIRBAD_QUEUE=false``
(then the router sends each request to the engine at once, as before the queue).

Per request: its wait is the time from its arrival to its first chunk (latency minus
its service time, the time from first chunk to last, measured at the client); with
the queue on also the router's ``x-mirbad-queue-ms``. The engine's own count of the
most completions it held at once (processing plus waiting inside it) is read from the
stub's ``/stub/stats``. The table is printed, the JSON written to bench/results/ and
the results into docs/performance.md between its "bench-queue" markers. The exit
status is 2 when a target is not met, 1 when the run failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    # Run as a script: bench/ is sys.path[0]; the repository root is what we import from.
    sys.path[0] = str(ROOT)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402

from bench import _procs, _report  # noqa: E402
from bench._load import CHAT_PATH  # noqa: E402
from bench._paths import MODEL, MirbadStack  # noqa: E402
from bench._tools import loud, say  # noqa: E402

DOC = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "bench" / "results"
MARKS = _report.Marks(
    begin="<!-- bench-queue:results:begin (written by bench/fair_queue.py; edits here are replaced) -->",
    end="<!-- bench-queue:results:end -->",
    section="## Fair queue (issue 18, bench/fair_queue.py)",
)
# Far above what the run sends: the key's own limits must not be what holds requests.
KEY_LIMITS = {"rpmLimit": 1_000_000_000, "tpmLimit": 2_000_000_000, "concurrencyLimit": 100_000}
DRAIN_LIMIT = 90.0  # most seconds to wait for the last answers after the arrivals end
REQUEST_TIMEOUT = 120.0
MODES = ("on", "off")


# -- the load --------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request: times are seconds since the run's start."""

    key: str
    arrival: float
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    status: int = 0
    queue_ms: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end is not None

    @property
    def service(self) -> float:
        assert self.first is not None and self.end is not None
        return self.end - self.first

    @property
    def wait(self) -> float:
        """Latency from arrival minus the service time: arrival to first chunk."""
        assert self.first is not None
        return self.first - self.arrival


@dataclass
class KeyLoad:
    name: str
    rate: float  # arrivals per second
    conns: int
    token: str = ""
    arrivals: list[float] = field(default_factory=list)


def schedule(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson arrival times in [0, duration)."""
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def body(chunks: int, chunk_ms: float) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "x_stub_chunks": chunks,  # the stub's service time: bench/stub_engine.py
        "x_stub_chunk_ms": chunk_ms,
    }


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    load: KeyLoad,
    slots: asyncio.Semaphore,
    payload: bytes,
    out: Outcome,
    t0: float,
) -> None:
    delay = t0 + out.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    async with slots:  # one of the key's client connections
        out.sent = time.perf_counter() - t0
        try:
            async with session.post(
                url,
                data=payload,
                headers={
                    "Authorization": f"Bearer {load.token}",
                    "Content-Type": "application/json",
                },
            ) as response:
                out.status = response.status
                header = response.headers.get("x-mirbad-queue-ms")
                if header is not None:
                    with contextlib.suppress(ValueError):
                        out.queue_ms = float(header)
                text = b""
                async for chunk in response.content.iter_any():
                    if out.first is None:
                        out.first = time.perf_counter() - t0
                    text += chunk
                out.end = time.perf_counter() - t0
                if response.status != 200:
                    out.error = text[:300].decode(errors="replace")
                elif b"data: [DONE]" not in text:
                    out.error = "the stream ended without data: [DONE]"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"


async def drive(url: str, loads: list[KeyLoad], payload: bytes, duration: float) -> list[Outcome]:
    """Send every key's arrivals; wait for the answers (bounded)."""
    sessions = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=load.conns, force_close=False),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
        )
        for load in loads
    ]
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter() + 0.2
    try:
        for load, session in zip(loads, sessions, strict=True):
            slots = asyncio.Semaphore(load.conns)
            for arrival in load.arrivals:
                out = Outcome(key=load.name, arrival=arrival)
                outcomes.append(out)
                tasks.append(
                    asyncio.ensure_future(_one(session, url, load, slots, payload, out, t0))
                )
        _done, pending = await asyncio.wait(tasks, timeout=0.2 + duration + DRAIN_LIMIT)
        for task in pending:
            task.cancel()
        for out in outcomes:
            if out.end is None and out.error is None:
                out.error = f"no answer within {duration + DRAIN_LIMIT:.0f} s of the start"
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for session in sessions:
            await session.close()
    return outcomes


# -- one run ---------------------------------------------------------------------------


def _stub(port: int, path: str, method: str = "GET") -> dict[str, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
        data: dict[str, Any] = json.loads(response.read())
        return data


def create_key(stack: MirbadStack, name: str) -> tuple[str, int | None]:
    status, row = stack.api(
        "POST", "/api/keys", {"name": name, "scopes": ["chat"], "models": [MODEL], **KEY_LIMITS}
    )
    if status != 201:
        raise RuntimeError(f"POST /api/keys ({name}) answered {status}: {row}")
    return row["key"], row.get("priority")


def check(url: str, loads: list[KeyLoad], payload: bytes) -> None:
    """One request per key answers 200 before the load starts (the route is known)."""

    async def once() -> str | None:
        async with aiohttp.ClientSession() as session:
            problem = None
            for load in loads:
                out = Outcome(key=load.name, arrival=0.0)
                await _one(
                    session, url, load, asyncio.Semaphore(1), payload, out, time.perf_counter()
                )
                if not out.ok:
                    problem = f"key {load.name}: status {out.status}, {out.error}"
            return problem

    deadline = time.monotonic() + 30
    problem: str | None = None
    while time.monotonic() < deadline:
        problem = asyncio.run(once())
        if problem is None:
            return
        time.sleep(1.0)
    raise RuntimeError(f"the stack does not answer the bench's request: {problem}")


def one_run(
    args: argparse.Namespace, procs: _procs.Processes, work: Path, mode: str, seed: int
) -> dict[str, Any]:
    env = {"MIRBAD_QUEUE": "true" if mode == "on" else "false"}
    stack = MirbadStack(
        procs, work / f"var-{mode}", external=args.external_services, env=env, stub_slots=True
    )
    stack.prepare()
    try:
        stack.start()
        instance = stack.start_model(parallel=args.slots)
        stub_port = instance["port"]
        stats = _stub(stub_port, "/stub/stats")
        if stats.get("limit") != args.slots:
            raise RuntimeError(f"the stub's slots are {stats.get('limit')}, not {args.slots}")
        say(f"queue {mode}: stub engine Ready on port {stub_port} with {args.slots} slots")
        rng = random.Random(seed)
        loads = [
            KeyLoad("heavy", args.heavy_rate, args.heavy_conns),
            KeyLoad("light", args.heavy_rate / args.ratio, args.clients - args.heavy_conns),
        ]
        priorities = {}
        for load in loads:
            load.token, priorities[load.name] = create_key(stack, f"bench-{load.name}")
            load.arrivals = schedule(load.rate, args.duration, rng)
        payload = json.dumps(body(args.chunks, args.chunk_ms)).encode()
        url = stack.url + CHAT_PATH
        check(url, loads, payload)
        _stub(stub_port, "/stub/stats/reset", "POST")
        say(
            f"queue {mode}: {sum(len(x.arrivals) for x in loads)} arrivals over "
            f"{args.duration:g} s (heavy {len(loads[0].arrivals)}, light {len(loads[1].arrivals)})"
        )
        started = time.perf_counter()
        outcomes = asyncio.run(drive(url, loads, payload, args.duration))
        elapsed = time.perf_counter() - started
        engine = _stub(stub_port, "/stub/stats")
        return summarize(mode, outcomes, engine, loads, priorities, elapsed, stack.services)
    finally:
        say(f"queue {mode}: stopping the MirbadLLM stack")
        stack.stop()


# -- figures ---------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float | None:
    """The p-th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-len(ordered) * p // 100))))
    return ordered[rank - 1]


def summarize(
    mode: str,
    outcomes: list[Outcome],
    engine: dict[str, Any],
    loads: list[KeyLoad],
    priorities: dict[str, int | None],
    elapsed: float,
    services: str,
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    failures: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            label = f"{o.status}: {o.error}" if o.status else str(o.error)
            failures[label[:200]] = failures.get(label[:200], 0) + 1
    first = min((o.arrival for o in outcomes), default=0.0)
    last = max((o.end for o in ok if o.end is not None), default=first)
    keys: dict[str, Any] = {}
    for load in loads:
        mine = [o for o in ok if o.key == load.name]
        waits = [o.wait * 1000 for o in mine]
        queue = [o.queue_ms for o in mine if o.queue_ms is not None]
        client = [(o.sent - o.arrival) * 1000 for o in mine]
        keys[load.name] = {
            "rate_per_s": load.rate,
            "connections": load.conns,
            "priority": priorities.get(load.name),
            "sent": sum(1 for o in outcomes if o.key == load.name),
            "answered": len(mine),
            "wait_p50_ms": pct(waits, 50),
            "wait_p95_ms": pct(waits, 95),
            "wait_max_ms": max(waits, default=None),
            "queue_header_count": len(queue),
            "queue_p50_ms": pct(queue, 50),
            "queue_p95_ms": pct(queue, 95),
            "client_wait_p95_ms": pct(client, 95),
        }
    services_ms = [o.service * 1000 for o in ok]
    slots, seconds = engine.get("limit"), engine.get("seconds")
    busy, served = engine.get("busy_slot_seconds"), engine.get("served")
    if slots and seconds and busy is not None:
        engine["utilization"] = busy / (slots * seconds)
        # Slot time not spent on a completion, per completion: the hand-over gap when
        # the engine is saturated (plus the idle start and end of the run).
        engine["idle_slot_ms_per_completion"] = (
            (slots * seconds - busy) / served * 1000 if served else None
        )
    return {
        "mode": mode,
        "services": services,
        "sent": len(outcomes),
        "answered_200": len(ok),
        "failed": len(outcomes) - len(ok),
        "failures": failures,
        "elapsed_s": elapsed,
        "makespan_s": last - first,
        "throughput_per_s": len(ok) / (last - first) if last > first else None,
        "service_p50_ms": pct(services_ms, 50),
        "service_p95_ms": pct(services_ms, 95),
        "keys": keys,
        "engine": engine,
    }


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue as met or not, with its figure; never rounded into a pass."""
    runs = {r["mode"]: r for r in results["runs"]}
    slots = results["meta"]["settings"]["slots"]
    out: list[dict[str, Any]] = []
    on, off = runs.get("on"), runs.get("off")
    if on is not None:
        slot_ms = on["service_p50_ms"]
        light = on["keys"]["light"]
        wait, header = light["wait_p95_ms"], light["queue_p95_ms"]
        met = None not in (slot_ms, wait) and wait <= 2 * slot_ms
        out.append(
            {
                "target": "queue on: light key's p95 wait within 2x the slot time",
                "met": met,
                "figure": f"p95 wait {_f(wait)} ms (arrival to first chunk) against 2 x "
                f"{_f(slot_ms)} ms = {_f(2 * slot_ms if slot_ms else None)} ms; "
                f"x-mirbad-queue-ms p95 {_f(header)} ms",
            }
        )
        held = on["engine"].get("max_held")
        out.append(
            {
                "target": f"queue on: the engine never holds more than its {slots} slots",
                "met": isinstance(held, int) and held <= slots,
                "figure": f"most held at once {held} (processing at most "
                f"{on['engine'].get('max_processing')})",
            }
        )
    for run in results["runs"]:
        out.append(
            {
                "target": f"queue {run['mode']}: nothing lost (every request answered 200)",
                "met": run["failed"] == 0 and run["answered_200"] == run["sent"],
                "figure": f"{run['answered_200']} of {run['sent']} answered 200, "
                f"{run['failed']} failed",
            }
        )
    if on is not None and off is not None:
        a, b = on["throughput_per_s"], off["throughput_per_s"]
        ratio = a / b if a and b else None
        out.append(
            {
                "target": "throughput with the queue on within 2 % of off at the same load",
                "met": ratio is not None and abs(ratio - 1) <= 0.02,
                "figure": f"on {_f(a, 2)}/s, off {_f(b, 2)}/s: "
                + (f"{(ratio - 1) * 100:+.2f} %" if ratio is not None else "n/a"),
            }
        )
    return out


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    s = meta["settings"]
    lines = [
        f"Run {meta['finished']} (`{meta['command']}`), {meta['machine']}; "
        f"{meta['services']}; raw figures in `{meta.get('json', 'bench/results/')}`.",
        "",
        f"Engine: {s['slots']} slots, each completion a stream of {s['chunks']} chunks "
        f"{s['chunk_ms']:g} ms apart (nominal slot time {s['nominal_slot_ms']:g} ms, capacity "
        f"{s['capacity_per_s']:.1f}/s). Load: {s['clients']} client connections, heavy key "
        f"{s['heavy_rate']:.1f}/s ({s['load']:g}x capacity, {s['heavy_conns']} connections), "
        f"light key {s['light_rate']:.1f}/s ({s['clients'] - s['heavy_conns']} connections), "
        f"Poisson arrivals for {s['duration_s']:g} s (seed {s['seed']}, the same in both runs), "
        "both keys priority 0.",
        "",
        "| | queue on | queue off |",
        "|---|---:|---:|",
    ]
    runs = {r["mode"]: r for r in results["runs"]}

    def row(label: str, get: Any) -> None:
        cells = []
        for mode in MODES:
            run = runs.get(mode)
            cells.append("not run" if run is None else get(run))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("requests sent / answered 200 / failed",
        lambda r: f"{r['sent']} / {r['answered_200']} / {r['failed']}")  # fmt: skip
    row("throughput (answers/s, first arrival to last answer)",
        lambda r: _f(r["throughput_per_s"], 2))  # fmt: skip
    row("service time p50 / p95 (first to last chunk, ms)",
        lambda r: f"{_f(r['service_p50_ms'])} / {_f(r['service_p95_ms'])}")  # fmt: skip
    for key in ("light", "heavy"):
        row(f"{key} key: wait p50 / p95 / max (arrival to first chunk, ms)",
            lambda r, k=key: f"{_f(r['keys'][k]['wait_p50_ms'])} / "
            f"{_f(r['keys'][k]['wait_p95_ms'])} / {_f(r['keys'][k]['wait_max_ms'])}")  # fmt: skip
        row(f"{key} key: x-mirbad-queue-ms p50 / p95",
            lambda r, k=key: "no header" if not r["keys"][k]["queue_header_count"]
            else f"{_f(r['keys'][k]['queue_p50_ms'])} / {_f(r['keys'][k]['queue_p95_ms'])}")  # fmt: skip
        row(f"{key} key: wait for a client connection p95 (ms)",
            lambda r, k=key: _f(r["keys"][k]["client_wait_p95_ms"]))  # fmt: skip
    row("engine: most held at once (processing + waiting inside it)",
        lambda r: str(r["engine"].get("max_held")))  # fmt: skip
    row("engine: most processing at once", lambda r: str(r["engine"].get("max_processing")))
    row("engine: slots in use (busy slot-seconds / slots x seconds)",
        lambda r: _f((r["engine"].get("utilization") or 0) * 100) + " %")  # fmt: skip
    row("engine: idle slot time per completion (ms)",
        lambda r: _f(r["engine"].get("idle_slot_ms_per_completion")))  # fmt: skip
    lines += ["", "| Target | Met | Figure |", "|---|---|---|"]
    for t in results["targets"]:
        lines.append(f"| {t['target']} | {'met' if t['met'] else '**NOT MET**'} | {t['figure']} |")
    for note in results["notes"]:
        lines += ["", note]
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/fair_queue.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--slots", type=int, default=4, help="the model's parallel slots")
    parser.add_argument("--chunks", type=int, default=11, help="chunks per completion")
    parser.add_argument("--chunk-ms", type=float, default=10.0, help="ms between two chunks")
    parser.add_argument(
        "--load", type=float, default=1.0, help="heavy key's rate as a share of capacity"
    )
    parser.add_argument("--ratio", type=float, default=10.0, help="heavy rate / light rate")
    parser.add_argument("--clients", type=int, default=64, help="client connections in all")
    parser.add_argument("--heavy-conns", type=int, default=48, help="of those, the heavy key's")
    parser.add_argument("--seed", type=int, default=18, help="the arrivals' random seed")
    parser.add_argument(
        "--modes",
        default="on,off",
        help="comma-separated: on (the queue), off (MIRBAD_QUEUE=false)",
    )
    parser.add_argument(
        "--external-services",
        action="store_true",
        help="give the stack MIRBAD_DATABASE_URL/MIRBAD_REDIS_URL from the environment "
        "(default: embedded SQLite and Redis)",
    )
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/performance.md")
    parser.add_argument(
        "--json", type=Path, help="where the raw JSON goes (default bench/results/)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory and its logs")
    args = parser.parse_args(argv)
    if not 1 <= args.duration <= 120:
        parser.error("--duration: 1 to 120 s")
    if not 1 <= args.slots <= 256 or not 2 <= args.chunks <= 1000 or not 0 < args.chunk_ms <= 1000:
        parser.error("--slots 1-256, --chunks 2-1000, --chunk-ms above 0 up to 1000")
    if not 0 < args.load <= 5 or not 1 <= args.ratio <= 1000:
        parser.error("--load above 0 up to 5, --ratio 1-1000")
    if not 2 <= args.clients <= 1024 or not 1 <= args.heavy_conns < args.clients:
        parser.error("--clients 2-1024; --heavy-conns at least 1 and below --clients")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        parser.error("--modes: on, off or both")
    args.modes = [m for m in MODES if m in modes]
    slot_s = (args.chunks - 1) * args.chunk_ms / 1000  # the stub sleeps between chunks
    args.capacity = args.slots / slot_s
    args.heavy_rate = args.load * args.capacity
    return args


def run(args: argparse.Namespace, procs: _procs.Processes, work: Path) -> dict[str, Any]:
    started = dt.datetime.now(dt.UTC)
    notes: list[str] = []
    before = _procs.foreign_snapshot()
    t = time.monotonic()
    runs = [one_run(args, procs, work, mode, args.seed) for mode in args.modes]
    foreign = _procs.foreign_seconds(before) / ((time.monotonic() - t) * (os.cpu_count() or 1))
    cores = os.cpu_count()
    notes.append(
        f"Host: {cores} cores shared with other sessions; processes this run did not start "
        f"used {foreign:.0%} of the machine's CPU during it, so the times are noisy."
    )
    if foreign > 0.10:
        loud(f"other processes used {foreign:.0%} of the CPU during the run")
    services = runs[0]["services"] if runs else ""
    results: dict[str, Any] = {
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in ["bench/fair_queue.py", *sys.argv[1:]]),
            "machine": f"{cores} cores, shared host",
            "services": services,
            "foreign_cpu_share": foreign,
            "settings": {
                "slots": args.slots,
                "chunks": args.chunks,
                "chunk_ms": args.chunk_ms,
                "nominal_slot_ms": (args.chunks - 1) * args.chunk_ms,
                "capacity_per_s": args.capacity,
                "load": args.load,
                "heavy_rate": args.heavy_rate,
                "light_rate": args.heavy_rate / args.ratio,
                "ratio": args.ratio,
                "clients": args.clients,
                "heavy_conns": args.heavy_conns,
                "duration_s": args.duration,
                "seed": args.seed,
                "modes": args.modes,
            },
        },
        "runs": runs,
        "notes": notes,
    }
    results["targets"] = targets(results)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, results = _report.run_cleanly(
        lambda procs, work: run(args, procs, work),
        prefix="mirbad-bench-queue-",
        keep=args.keep,
        stack_logs="var-*/logs",
    )
    if results is None:
        return code
    target = args.json or RESULTS / f"queue-{_report.stamp(results)}.json"
    _report.publish(results, target, render, doc=None if args.no_doc else DOC, marks=MARKS)
    missed = [t for t in results["targets"] if not t["met"]]
    return 2 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
