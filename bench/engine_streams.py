"""Streaming through /v1 with a real engine (issue 19): the engine directly against /v1, in one run.

    .venv/bin/python bench/engine_streams.py    # 16, 64, 256 streams: 2.5-4.5 minutes on 2 cores
    .venv/bin/python bench/engine_streams.py --concurrency 16 --duration 3 --retries 0  # smoke run

A real MirbadLLM stack (``mirbad_site.launcher up`` on free ports, its own data
directory under /tmp; embedded SQLite and Redis unless ``--external-services``) whose
local agent launches a real llama-server (``--engine``, default
MIRBAD_TEST_LLAMA_SERVER: a folder laid out by ``python -m agent install-llama-server``)
serving the tiny GGUF of protocol/tinygguf.py on the CPU, with ``parallel`` equal to
the highest concurrency (``--slots``; one slot per stream, context 512 per slot; the
router's fair queue counts the same slots) and one thread
(``--threads``): llama.cpp's threads wait for each other spinning, and with two of
them on two cores shared with the router, the agent and the load, one descheduled
thread stalls the other (tokens per second fell tenfold from one second to the next).

Two paths reach that one engine process:

- direct: the engine's own port with the key the agent gave it (processes.json), as
  a client beside MirbadLLM would;
- /v1: the master's router (web process) and the agent's proxy (mTLS), with a /v1 key
  with limits on (far above the load, so the limit code runs but never refuses).

Every stream is the same request: a chat completion of ``--max-tokens`` tokens,
``ignore_eos`` so that every stream has exactly that many, temperature 0 so that every
stream is the same text, the tiny model's byte tokens banned (``logit_bias``) so that
each token is one text event, and no ``stream_options`` (what most clients send: the router
then adds ``include_usage`` and filters the stream, its costlier case). Before
measuring, one stream through each path is checked: status, ``data: [DONE]``, the
same text on both paths, and one text event per generated token.

The load is bench/tokenload.py: ``C`` keep-alive connections in a closed loop (each
sends the next stream as soon as the previous one ends), a warm-up, then a measured
window in which it counts tokens (text events) as they arrive and keeps the time to
first token of every stream whose first token arrives inside the window. The paths
alternate at each concurrency, ABBA for ``--rounds 2`` (direct, /v1, /v1, direct), so
a drift of the machine's load hits both the same. CPU seconds of each process (engine,
web, agent, Redis, the rest of the stack, the load client, and every process this run
did not start) are read in each window. A point whose window saw processes this run did
not start take more than ``--max-foreign`` of the machine is measured again at once
(``--retries``, until ``--budget``); the summary keeps the undisturbed tries, else the
least disturbed one. The warm-up and window grow with the streams' length at high
concurrency (``timing``), the same for both paths at one concurrency.

Targets (issue 19): through /v1 at most 1 % fewer tokens per second and at most 2 ms
more time to first token (p50; p95 is reported too) than directly, at every
concurrency. The table is printed and the JSON written to bench/results/. The exit
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
import contextlib  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402

from bench import _load, _procs  # noqa: E402
from bench._engine_summary import LABELS, PATHS, render, summarise  # noqa: E402
from bench._measure import busy_seconds  # noqa: E402
from bench._paths import MODEL, MirbadStack  # noqa: E402
from bench._report import run_cleanly  # noqa: E402
from bench._tools import loud, say  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TOKENLOAD = ROOT / "bench" / "tokenload.py"
MAX_SLOTS = 256  # the most llama.cpp slots a model may have (models_registry/llamacpp.py)


# -- the request and its check -----------------------------------------------------------


# The tiny GGUF's vocabulary (protocol/tinygguf.py): 3 control tokens, then the 256 byte
# tokens, then 8 words. A byte token that ends inside a UTF-8 character is held back by
# llama-server and sent with the next, so the stream would carry fewer text events than
# tokens; banning them leaves the words, one text event per token.
NOT_WORDS = range(3 + 256)
LOGIT_BIAS_NOTE = f"[[token, false]] for every token {NOT_WORDS.start}..{NOT_WORDS.stop - 1}"


def stream_body(max_tokens: int) -> dict[str, Any]:
    """The one request of the run (see the module's docstring for why each field)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": [[token, False] for token in NOT_WORDS],
        "stream": True,
    }


@dataclass
class Checked:
    """One stream read whole: its text events, its text, its usage if it had one."""

    text_events: int
    text: str
    completion_tokens: int | None
    done: bool


def read_stream(url: str, headers: dict[str, str], body: dict[str, Any]) -> Checked:
    request = urllib.request.Request(  # noqa: S310 - loopback only
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url}: {exc.code}: {exc.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"POST {url}: {exc}") from None
    parts: list[str] = []
    usage: int | None = None
    done = False
    for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        data = event[len(b"data: ") :].strip()
        if data == b"[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if isinstance(content, str):
                parts.append(content)
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"].get("completion_tokens")
    # What bench/tokenload.py counts: the marker of a text event in the raw stream.
    return Checked(raw.count(b'"content":"'), "".join(parts), usage, done)


def check_paths(
    paths: dict[str, BenchPath], body: dict[str, Any], max_tokens: int
) -> dict[str, Any]:
    """One stream per path, and one with usage directly: the load counts what it means to."""
    with_usage = {**body, "stream_options": {"include_usage": True}}
    usage = read_stream(paths["direct"].url, paths["direct"].headers, with_usage)
    if usage.completion_tokens != max_tokens:
        raise RuntimeError(
            f"the engine generated {usage.completion_tokens} tokens, not max_tokens "
            f"{max_tokens} (ignore_eos not honoured?)"
        )
    seen = {name: read_stream(p.url, p.headers, body) for name, p in paths.items()}
    for name, checked in seen.items():
        if not checked.done:
            raise RuntimeError(f"{name}: the stream did not end with data: [DONE]")
    if seen["direct"].text != seen["v1"].text:
        raise RuntimeError(
            "the two paths streamed different texts at temperature 0: "
            f"{seen['direct'].text[:80]!r} / {seen['v1'].text[:80]!r}"
        )
    if seen["direct"].text_events != seen["v1"].text_events:
        raise RuntimeError(
            f"text events differ: direct {seen['direct'].text_events}, /v1 {seen['v1'].text_events}"
        )
    events = seen["direct"].text_events
    if events != max_tokens:
        raise RuntimeError(
            f"{events} text events per stream for {max_tokens} tokens: the load would "
            "count something other than tokens"
        )
    say(f"checked: one text event per token ({events}) on both paths, the same text")
    return {
        "tokens_per_stream": max_tokens,
        "text_events_per_stream": events,
        "text_sample": seen["direct"].text[:120],
    }


# -- the paths and their CPU ----------------------------------------------------------


@dataclass
class BenchPath:
    name: str
    url: str
    headers: dict[str, str]


@dataclass
class CpuGroups:
    """The processes whose CPU each point reads, by role."""

    groups: dict[str, list[psutil.Process]] = field(default_factory=dict)

    def read(self) -> dict[str, float]:
        return {name: _procs.cpu_seconds(procs) for name, procs in self.groups.items()}


def cpu_groups(stack: MirbadStack, engine: psutil.Process) -> CpuGroups:
    def pid(name: str) -> list[psutil.Process]:
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            return [psutil.Process(stack.pid(name))]
        return []

    groups = CpuGroups({"engine": [engine], "web": pid("web"), "agent": pid("agent")})
    rest = pid("monitor") + pid("worker") + pid("enroll") + pid("beat")
    redis: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        assert stack.child is not None
        launcher = psutil.Process(stack.child.pid)
        rest.append(launcher)
        # The embedded Redis has no pid file: it is the launcher's child redis-server.
        redis = [k for k in launcher.children() if "redis" in k.name()]
    groups.groups["redis"] = redis
    groups.groups["rest of the stack"] = rest
    return groups


# -- one point ------------------------------------------------------------------------

# A stream's length at concurrency c is about c x max_tokens / (tokens per second); the
# rate measured at the previous concurrency is the estimate, taken STREAM_MARGIN times
# longer because the rate falls as the streams grow in number. The connections start
# spread over one stream length, the window opens once the last has had one stream to
# itself, and it lasts at least three stream lengths: both bounded, to keep a run short.
STREAM_MARGIN = 1.5
MAX_WARMUP = 8.0
MAX_WINDOW = 8.0


@dataclass(frozen=True)
class Timing:
    warmup: float
    spread: float
    duration: float


def timing(
    concurrency: int, max_tokens: int, rate: float | None, args: argparse.Namespace
) -> Timing:
    """The warm-up, start spread and window of every point at ``concurrency``."""
    if not rate:
        return Timing(args.warmup, args.warmup / 2, args.duration)
    stream = STREAM_MARGIN * concurrency * max_tokens / rate
    warmup = min(MAX_WARMUP, max(args.warmup, 2 * stream))
    spread = min(stream, warmup / 2)
    duration = min(MAX_WINDOW, max(args.duration, 3 * stream))
    return Timing(round(warmup, 1), round(spread, 1), round(duration, 1))


def measure(
    path: BenchPath,
    concurrency: int,
    body: dict[str, Any],
    cpu: CpuGroups,
    when: Timing,
) -> dict[str, Any]:
    marks: dict[str, Any] = {}

    def begin() -> None:
        marks["foreign"] = _procs.foreign_snapshot()
        marks["cpu"] = cpu.read()
        marks["busy"] = busy_seconds()
        marks["t"] = time.monotonic()

    def end() -> None:
        marks["wall"] = time.monotonic() - marks["t"]
        after = cpu.read()
        marks["cpu_s"] = {k: after[k] - marks["cpu"][k] for k in after}
        marks["busy_s"] = busy_seconds() - marks["busy"]
        marks["foreign_s"] = _procs.foreign_seconds(marks["foreign"])

    result = _load.run_stream_load(
        path.url,
        path.headers,
        body,
        concurrency=concurrency,
        warmup=when.warmup,
        seconds=when.duration,
        on_begin=begin,
        on_end=end,
        python=sys.executable,
        script=TOKENLOAD,
        extra=("--spread", f"{when.spread:g}"),
    )
    if "cpu_s" not in marks:
        raise RuntimeError("bench/tokenload.py never opened its window")
    cores = os.cpu_count() or 1
    cpu_s = {**marks["cpu_s"], "load client": result["client_cpu_s"]}
    point = {
        "path": path.name,
        "concurrency": concurrency,
        "timing": when.__dict__,
        **{k: v for k, v in result.items() if k != "client_cpu_s"},
        "cpu_s": cpu_s,
        "foreign_cpu_s": marks["foreign_s"],
        "machine_busy_share": marks["busy_s"] / (marks["wall"] * cores),
        "foreign_share": marks["foreign_s"] / (marks["wall"] * cores),
    }
    say(
        f"  {LABELS[path.name]:<16} c={concurrency:<4} {result['tokens_per_s']:8.0f} tokens/s"
        f"  TTFT p50 {result['ttft_p50_ms']:7.2f} ms  p95 {result['ttft_p95_ms']:7.2f} ms"
        f"  ({result['ttft_count']} first tokens, {result['streams']} streams ended,"
        f" errors {result['errors_in_window']}, busy {point['machine_busy_share']:.0%},"
        f" foreign {point['foreign_share']:.0%})"
    )
    if result["errors_in_window"] or result["tokens"] == 0:
        loud(f"{path.name} at c={concurrency}: {result['errors']} {result['first_error']}")
    return point


def measure_quiet(
    path: BenchPath,
    concurrency: int,
    body: dict[str, Any],
    cpu: CpuGroups,
    when: Timing,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One point, measured again (``--retries`` times at most) while processes this run
    did not start take more than ``--max-foreign`` of the machine in its window. The
    summary keeps the undisturbed tries, else the least disturbed one (``kept``)."""
    tries: list[dict[str, Any]] = []
    for _ in range(1 + args.retries):
        point = measure(path, concurrency, body, cpu, when)
        tries.append(point)
        if point["foreign_share"] <= args.max_foreign:
            break
        if time.monotonic() > args.retry_until:
            say(f"  disturbed ({point['foreign_share']:.0%}); past --budget: not measured again")
            break
        say(f"  disturbed: other processes took {point['foreign_share']:.0%} of the CPU")
    quiet = [p for p in tries if p["foreign_share"] <= args.max_foreign]
    for p in tries:
        p["kept"] = p in quiet if quiet else p is min(tries, key=lambda t: t["foreign_share"])
    return tries


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/engine_streams.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--concurrency", default="16,64,256", help="comma-separated streams")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per point")
    parser.add_argument(
        "--rounds", type=int, default=2, help="points per path and concurrency (ABBA order)"
    )
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.10,
        help="a point whose window saw other processes take more of the machine's CPU than "
        "this share is measured again (default 0.10)",
    )
    parser.add_argument("--retries", type=int, default=2, help="at most this many (default 2)")
    parser.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds after which a disturbed point is no longer measured again (default 240)",
    )
    parser.add_argument(
        "--queue",
        choices=("on", "off"),
        default="on",
        help="the router's fair queue (off: MIRBAD_QUEUE=false, to see its share)",
    )
    parser.add_argument(
        "--slots", type=int, help="the model's parallel (default: the highest concurrency)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the engine's threads (default 1: see docs/performance.md for why)",
    )
    parser.add_argument(
        "--engine",
        type=Path,
        default=Path(os.environ["MIRBAD_TEST_LLAMA_SERVER"])
        if os.environ.get("MIRBAD_TEST_LLAMA_SERVER")
        else None,
        help="a laid-out llama-server (default MIRBAD_TEST_LLAMA_SERVER)",
    )
    parser.add_argument(
        "--external-services",
        action="store_true",
        help="give the stack MIRBAD_DATABASE_URL/MIRBAD_REDIS_URL from the "
        "environment (default: embedded SQLite and Redis)",
    )
    parser.add_argument(
        "--json", type=Path, help="where the raw JSON goes (default bench/results/)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory and its logs")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency: comma-separated whole numbers")
    if not args.concurrency or any(not 1 <= c <= MAX_SLOTS for c in args.concurrency):
        parser.error(f"--concurrency: values between 1 and {MAX_SLOTS} (one slot per stream)")
    args.slots = args.slots or max(args.concurrency)
    if not max(args.concurrency) <= args.slots <= MAX_SLOTS:
        parser.error(f"--slots: from the highest concurrency to {MAX_SLOTS}")
    args.retry_until = time.monotonic() + args.budget
    if not 0 <= args.retries <= 5 or not 0 < args.max_foreign <= 1:
        parser.error("--retries 0-5, --max-foreign above 0, at most 1")
    if not 1 <= args.threads <= 64:
        parser.error("--threads: 1-64")
    if not 1 <= args.max_tokens <= 400:
        parser.error("--max-tokens: 1-400 (the tiny model's context is 512 per slot)")
    if not 1 <= args.duration <= 60 or not 0.5 <= args.warmup <= 30 or not 1 <= args.rounds <= 6:
        parser.error("--duration 1-60 s, --warmup 0.5-30 s, --rounds 1-6")
    if args.engine is None:
        parser.error("--engine: give a laid-out llama-server or set MIRBAD_TEST_LLAMA_SERVER")
    if not args.engine.is_file():
        parser.error(f"--engine: {args.engine} does not exist")
    return args


def order(rounds: int) -> list[list[str]]:
    """ABBA...: direct first in even rounds, /v1 first in odd ones."""
    return [list(PATHS) if r % 2 == 0 else list(reversed(PATHS)) for r in range(rounds)]


def run(args: argparse.Namespace, procs: _procs.Processes, work: Path) -> dict[str, Any]:
    started = dt.datetime.now(dt.UTC)
    clock = time.monotonic()
    stack = MirbadStack(
        procs,
        work / "var",
        external=args.external_services,
        env={"MIRBAD_QUEUE": "false"} if args.queue == "off" else {},
        engine=args.engine,
    )
    stack.prepare()
    try:
        stack.start()
        instance = stack.start_model(parallel=args.slots, settings={"threads": args.threads})
        engine = psutil.Process(instance["pid"])
        say(
            f"llama-server Ready on port {instance['port']} (pid {engine.pid}), "
            f"{args.slots} slots, {args.threads} thread(s), launched by the agent"
        )
        key, key_note, _limits = stack.create_key()
        chat = _load.CHAT_PATH
        paths = {
            "direct": BenchPath(
                "direct",
                f"http://127.0.0.1:{instance['port']}{chat}",
                {"Authorization": f"Bearer {stack.engine_key(instance['instanceId'])}"},
            ),
            "v1": BenchPath("v1", f"{stack.url}{chat}", {"Authorization": f"Bearer {key}"}),
        }
        body = stream_body(args.max_tokens)
        checked = check_paths(paths, body, args.max_tokens)
        cpu = cpu_groups(stack, engine)
        before = _procs.foreign_snapshot()
        time.sleep(2.0)
        background = _procs.foreign_seconds(before) / (2.0 * (os.cpu_count() or 1))
        if background > 0.10:
            loud(
                f"other processes use {background:.0%} of the machine's CPU: numbers will be noisy"
            )
        points: list[dict[str, Any]] = []
        rate: float | None = None
        for c in args.concurrency:
            when = timing(c, args.max_tokens, rate, args)
            say(
                f"{c} concurrent streams of {args.max_tokens} tokens (warm-up {when.warmup:g} s, "
                f"starts over {when.spread:g} s, window {when.duration:g} s)"
            )
            for names in order(args.rounds):
                for name in names:
                    points += measure_quiet(paths[name], c, body, cpu, when, args)
            rates = [p["tokens_per_s"] for p in points if p["concurrency"] == c and p["kept"]]
            rate = min(rates) if min(rates) > 0 else None
        finished = dt.datetime.now(dt.UTC)
        return {
            "meta": {
                "started": started.isoformat(timespec="seconds"),
                "finished": finished.isoformat(timespec="seconds"),
                "seconds": time.monotonic() - clock,
                "command": " ".join(
                    shlex.quote(a) for a in ["bench/engine_streams.py", *sys.argv[1:]]
                ),
                "settings": {
                    "concurrency": args.concurrency,
                    "max_tokens": args.max_tokens,
                    "duration_s": args.duration,
                    "warmup_s": args.warmup,
                    "rounds": args.rounds,
                    "order": ", ".join("/".join(r) for r in order(args.rounds)),
                    "slots": args.slots,
                    "threads": args.threads,
                    "queue": args.queue,
                    "max_foreign": args.max_foreign,
                    "retries": args.retries,
                    "context_per_slot": 512,
                    "body": {**body, "logit_bias": LOGIT_BIAS_NOTE},
                },
                "engine": {
                    "path": str(args.engine),
                    "version": args.engine.resolve().parent.name,
                    "argv": engine.cmdline()[1:],
                },
                "check": checked,
                "machine": {
                    "cores": os.cpu_count(),
                    "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                },
                "git": _git(),
                "services": stack.services,
                "key": key_note,
                "background_cpu_share": background,
            },
            "points": points,
            "summary": summarise(points, args.concurrency),
        }
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup
        say("stopping the MirbadLLM stack")
        stack.stop()


def _git() -> str:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        head = subprocess.run(
            ["git", "--no-optional-locks", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "diff", "--quiet", "HEAD", "--", "router", "agent"],
            cwd=ROOT,
            timeout=30,
            check=False,
        ).returncode
        return f"{head}{' (router/agent changed since)' if dirty == 1 else ''}"
    return "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, results = run_cleanly(
        lambda procs, work: run(args, procs, work),
        prefix="mirbad-engine-streams-",
        keep=args.keep,
        stack_logs="var/logs",
    )
    if results is None:
        return code
    stamp = results["meta"]["finished"].replace(":", "").replace("+0000", "Z")
    target = args.json or RESULTS / f"engine-streams-{stamp}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    for point in results["points"]:
        # The summary pooled them; thousands of numbers per point would swamp the file.
        point.pop("ttft_ms", None)
    target.write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + render(results) + "\n", flush=True)
    say(f"wrote {target}")
    met = all(row["tps_met"] and row["ttft_met"] for row in results["summary"])
    return 0 if met else 2


if __name__ == "__main__":
    sys.exit(main())
