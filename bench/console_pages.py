"""Console page server time with 100 nodes and 500 models (issues 14, 19; not a test).

Run: ``.venv/bin/python bench/console_pages.py`` from the repository root, with
``MIRBAD_REDIS_URL`` pointing at a Redis it may write a few thousand keys to (default
``redis://127.0.0.1:6379/15``; the keys are the status cache's and the telemetry
history's, removed at the end). It makes a fresh data directory under /tmp (SQLite,
migrated; ``--database-url`` for PostgreSQL), fills it with ``--nodes`` nodes (default
100) and ``--models`` models (default 500, one replica each, spread over the nodes),
a status record per node with telemetry and Ready instances (each with the fingerprint
the agent reports for its definition, so restart-pending checks run as in a fleet), and
``--history-steps`` 5 s telemetry points per node (an hour by default; one node in
``STALLED_EVERY`` is stalled, its models flagged). Before each page's runs every node's
record, newest point and stall flags are written again (``_refresh``): a monitor keeps
them current, and a fill or a page's runs take longer than the 15 s after which a silent
node is Offline. Then it renders each page ``--runs`` times (default 30) through
Django's test client as a logged-in operator: the whole server side (URL resolution,
middleware, sessions, database, Redis, templates), no network, and no test
instrumentation of the templates. Each page's gen-2 garbage collections during its runs
are counted beside its times (they are the slow outliers). ``--pages`` measures only
some pages; ``--profile URL`` times one URL and prints a cProfile of one render.

Beside them, in the same run, the reference: Django admin's node changelist (the same
nodes through Django's own code, 100 a page) and the login page (an almost empty
template). Prints p50, p95 and max per page in ms and ``--json FILE`` writes them; the
target is under 150 ms per page (docs/performance.md). The Overview at 1,000 nodes and
5,000 models (issue 19): ``--nodes 1000 --models 5000 --history-steps 3 --pages Overview``
(it reads only each node's newest point, and the fill takes seconds instead of minutes).
The two API answers issue 19 measured slow are pages too: ``--pages "API nodes,Placement
suggestions"`` (the first model has a 30 GiB budget and every node four GPUs, so the
ranking runs admission on every node). Beside p50/p95/max each page shows its fastest
run (``min``), the process's CPU per render (``CPU p50``) and its answer's size: on a
machine shared with other work the wall times move with the neighbours, those less.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def _setup_env(args: argparse.Namespace) -> Path:
    data = Path(tempfile.mkdtemp(prefix="mirbad-bench-pages-"))
    os.environ["MIRBAD_DATA_PATH"] = str(data)
    os.environ["MIRBAD_REDIS_URL"] = args.redis_url
    if args.database_url:
        os.environ["MIRBAD_DATABASE_URL"] = args.database_url
    # The test client's host; no setup_test_environment(): it instruments every template
    # render to keep a copy of its context, which a server does not pay.
    os.environ["MIRBAD_ALLOWED_HOSTS"] = "testserver"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")
    return data


def _gpu(node_id: str, index: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{node_id}-{index}",  # admission ranks GPUs by UUID (suggestions)
        "name": "H100",
        "memoryTotalBytes": 80 * 2**30,
        "memoryUsedBytes": 40 * 2**30,
        "utilizationPercent": 55.0,
    }


# One node in this many has stalled engines (a few Needs attention lines, as in a fleet).
STALLED_EVERY = 100
# The engine version the nodes report running (the fingerprints are computed with it).
AGENT_ENGINE_VERSION = "0.6.0-dev"
# History is written for this many nodes at once (one event loop, concurrent writes).
WRITERS = 50


class Fleet:
    """What the fill made, for :func:`_refresh`: each node's sample and instance ids."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[str, Any]] = {}
        self.placements: dict[str, list[str]] = {}
        self.steps: dict[str, int] = {}
        self.fingerprints: dict[str, str] = {}  # by instance id, as the agent reports it


def _stalled(node_id: str) -> bool:
    """Every STALLED_EVERY-th node's engines are busy and make no tokens: flagged stalled
    once their history covers 5 minutes (nodes/stalls.py)."""
    return int(node_id.rsplit("-", 1)[1]) % STALLED_EVERY == STALLED_EVERY - 1


def _engines(fleet: Fleet, node_id: str) -> list[dict[str, Any]]:
    """The node's engine values at its next step."""
    step = fleet.steps[node_id] = fleet.steps.get(node_id, -1) + 1
    stalled = _stalled(node_id)
    counters = 1000.0 + (0 if stalled else 50 * step)
    return [
        {"instanceId": iid, "pid": 1, "cpuPercent": 90.0, "rssBytes": 3 * 2**30,
         "metrics": {"requestsRunning": 1.0, "requestsWaiting": 0.0,
                     "promptTokensTotal": counters, "generationTokensTotal": counters,
                     "kvCacheUsageRatio": 0.2}}
        for iid in fleet.placements[node_id]
    ]  # fmt: skip


async def _node_history(fleet: Fleet, node_id: str, steps: int, now: float) -> None:
    from nodes import stalls, telemetry

    if _stalled(node_id):  # whatever --history-steps says: the flag needs its 5 minutes
        steps = max(steps, int(stalls.WINDOW_SECONDS // telemetry.INTERVAL_SECONDS) + 2)
    for step in range(steps):  # an hour at 5 s by default, the newest at ``now``
        sample = {**fleet.samples[node_id], "engines": _engines(fleet, node_id)}
        await telemetry.arecord(node_id, sample, now=now - 5 * (steps - 1 - step))


async def _node_current(fleet: Fleet, node_id: str, now: float) -> None:
    """What the monitor writes at each sample: the record, a point and the stall flags."""
    from nodes import stalls, status_cache, telemetry

    sample = fleet.samples[node_id]
    instances = {
        iid: {
            "instanceId": iid,
            "state": "Ready",
            "measured": {"bytes": 3 * 2**30},
            "fingerprint": fleet.fingerprints.get(iid),
            "executable": {"name": "llama.cpp", "version": AGENT_ENGINE_VERSION},
        }
        for iid in fleet.placements[node_id]
    }
    await status_cache.awrite(
        {
            "nodeId": node_id,
            "state": "Online",
            "reasons": [],
            "lastSeen": now,
            "instances": instances,
            "telemetry": sample,
        }
    )
    await telemetry.arecord(node_id, {**sample, "engines": _engines(fleet, node_id)}, now=now)
    await stalls.aupdate(node_id, now)


def _each_node(fleet: Fleet, work: Any) -> None:
    """``work(node_id)`` for every node, WRITERS at a time, in one event loop (the async
    Redis client is one per loop)."""
    import asyncio

    async def run() -> None:
        ids = list(fleet.samples)
        for first in range(0, len(ids), WRITERS):
            await asyncio.gather(*(work(n) for n in ids[first : first + WRITERS]))

    asyncio.run(run())


def _refresh(fleet: Fleet) -> None:
    """Every node Online again, as its monitor keeps it: a fill or a page's runs take longer
    than the 15 s after which a silent node is Offline (nodes/status.py) and the minute
    after which its telemetry is not current. Outside the timed renders."""
    now = time.time()
    _each_node(fleet, lambda node_id: _node_current(fleet, node_id, now))


def _fill(
    nodes: int, models: int, history_steps: int = 720, fingerprints: bool = True
) -> tuple[Fleet, str, int]:
    """The fleet: nodes with status and history, models placed one replica each."""
    from django.contrib.auth import get_user_model
    from django.db import transaction

    from agent.engines._spec import fingerprint, parse_launch_spec
    from models_registry import lifecycle
    from models_registry.models import ModelDefinition, Placement
    from nodes.models import Node

    fleet = Fleet()
    with transaction.atomic():  # one commit: SQLite syncs the disk at each
        rows = Node.objects.bulk_create(
            Node(
                node_id=f"node-{i:03d}",
                address=f"https://10.0.{i // 250}.{i % 250 + 1}:9443",
                approved=True,
                spki_pin="A" * 43 + "=",
                os="Linux",
                arch="x86_64",
                agent_version="0.9.0",
                protocol_version=1,
            )
            for i in range(nodes)
        )
        defined = ModelDefinition.objects.bulk_create(
            ModelDefinition(
                served_name=f"model-{j:03d}", source_folder=f"m{j}", source_file="m.gguf"
            )
            for j in range(models)
        )
        placed = Placement.objects.bulk_create(
            Placement(model=model, node=rows[j % nodes]) for j, model in enumerate(defined)
        )
        user = get_user_model().objects.create_user("bench", password="x", is_staff=True)  # noqa: S106
        user.is_superuser = True
        user.save()
    fleet.placements = {n.node_id: [] for n in rows}
    for placement in placed:
        fleet.placements[placement.node.node_id].append(placement.instance_id)
        # What the agent reports for the definition it started: settings unchanged since,
        # so no model is "restart pending", but the Overview has every one to check.
        if fingerprints:
            spec = parse_launch_spec(lifecycle.launch_spec(placement.model, placement))
            fleet.fingerprints[placement.instance_id] = fingerprint(spec, AGENT_ENGINE_VERSION)
    for node in rows:
        fleet.samples[node.node_id] = {
            "cpuPercent": 42.0,
            "cpuPerCore": [40.0] * 16,
            "load": [2.0, 1.5, 1.0],
            "memory": {
                "totalBytes": 256 * 2**30,
                "usedBytes": 90 * 2**30,
                "availableBytes": 166 * 2**30,
                "percent": 35.0,
            },
            "disks": [{"path": "/srv/models", "totalBytes": 2 * 2**40, "freeBytes": 2**40}],
            "gpus": [_gpu(node.node_id, g) for g in range(4)],
        }
    now = time.time()
    _each_node(fleet, lambda node_id: _node_history(fleet, node_id, history_steps, now))
    _refresh(fleet)
    first = ModelDefinition.objects.order_by("pk").first()
    assert first is not None
    # A budget, so placement suggestions run admission on every GPU of every node.
    first.memory_budget_bytes = 30 * 2**30
    first.save(update_fields=["memory_budget_bytes"])
    return fleet, rows[0].node_id, first.pk


_GC_PAUSES: list[tuple[int, float]] = []
_gc_started = [0.0]


def _gc_watch(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        _GC_PAUSES.append((info["generation"], (time.perf_counter() - _gc_started[0]) * 1000))


def _measure(client: Any, url: str, runs: int) -> dict[str, float]:
    times = []
    cpu = []  # this process's CPU per render: what a busy shared machine does not inflate
    size = 0
    for _ in range(runs + 2):
        started, cpu_started = time.perf_counter(), time.process_time()
        response = client.get(url)
        elapsed = (time.perf_counter() - started) * 1000
        cpu.append((time.process_time() - cpu_started) * 1000)
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}")
        times.append(elapsed)
        size = len(response.content)
    times, cpu = times[2:], cpu[2:]  # the first two warm caches (templates, connections)
    gen2 = [ms for gen, ms in _GC_PAUSES if gen == 2]
    _GC_PAUSES.clear()
    return {
        "gc_gen2_pauses": len(gen2),
        "gc_gen2_max_ms": round(max(gen2, default=0.0), 1),
        "p50_ms": round(statistics.median(times), 1),
        "p95_ms": round(_percentile(times, 95), 1),
        "max_ms": round(max(times), 1),
        "cpu_p50_ms": round(statistics.median(cpu), 1),
        "min_ms": round(min(times), 1),  # the least disturbed by neighbours
        "kb": round(size / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("MIRBAD_REDIS_URL", "redis://127.0.0.1:6379/15"),
        help="the Redis database it fills and empties (default MIRBAD_REDIS_URL, else db 15)",
    )
    parser.add_argument("--database-url", default="")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--history-steps",
        type=int,
        default=720,
        help="5 s points per node (the stalled nodes get at least their 5 minutes); the "
        "Overview reads only the newest, so a few are enough for it and fill much faster",
    )
    parser.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the heap in the collector (mirbad_site/asgi.py freezes it at start)",
    )
    parser.add_argument(
        "--profile", default="", help="time this URL --runs times, then cProfile one render of it"
    )
    parser.add_argument(
        "--no-fingerprints",
        dest="fingerprints",
        action="store_false",
        help="instances without the fingerprint the agent reports (no restart-pending "
        "checks: what the bench measured before issue 19)",
    )
    parser.add_argument(
        "--pages",
        default="",
        help="only the pages whose name contains one of these comma-separated words "
        "(the references are always measured), e.g. --pages Overview",
    )
    args = parser.parse_args()
    _setup_env(args)

    import django

    django.setup()
    from django.core.management import call_command
    from django.test import Client

    from nodes import status_cache

    call_command("migrate", verbosity=0)
    redis = status_cache.sync_client()
    redis.flushdb()
    started = time.perf_counter()
    fleet, node_id, model_id = _fill(args.nodes, args.models, args.history_steps, args.fingerprints)
    print(
        f"filled {args.nodes} nodes, {args.models} models in {time.perf_counter() - started:.0f} s"
    )
    objects = len(gc.get_objects())
    if args.gc_freeze:
        # As the web process does once loaded (mirbad_site/asgi.py).
        gc.collect()
        gc.freeze()
    print(f"{objects} objects tracked by the garbage collector after the fill")
    client = Client()
    client.login(username="bench", password="x")  # noqa: S106
    if args.profile:
        import cProfile
        import pstats

        # Its times first (the first two renders warm up), then one render profiled.
        _refresh(fleet)
        timed = _measure(client, args.profile, args.runs)
        print(f"{args.profile}: p50 {timed['p50_ms']} ms, max {timed['max_ms']} ms")
        _refresh(fleet)
        profiler = cProfile.Profile()
        profiler.enable()
        client.get(args.profile)
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(25)
        redis.flushdb()
        return
    pages = {
        "Overview /": "/",
        "Overview summary (live.js)": "/overview/summary/",
        "Nodes /nodes/": "/nodes/",
        "Node page /nodes/<id>/": f"/nodes/{node_id}/",
        "Node history 1h": f"/nodes/{node_id}/history.json",
        "Node history 24h": f"/nodes/{node_id}/history.json?window=24h",
        "Models /models/": "/models/",
        "Model page /models/<id>/": f"/models/{model_id}/",
        "Downloads /downloads/": "/downloads/",
        "Usage /usage/": "/usage/",
        "Keys /keys/": "/keys/",
        # The two API answers issue 19 measured slow at 1,000 nodes (session auth: the
        # operator logged in, as the console's scripts call them).
        "API nodes /api/nodes": "/api/nodes",
        "Placement suggestions /api/models/<id>/placement-suggestions": (
            f"/api/models/{model_id}/placement-suggestions"
        ),
        "reference: admin node changelist": "/admin/nodes/node/",
        "reference: login page": "/login/",
    }
    wanted = [w.strip().lower() for w in args.pages.split(",") if w.strip()]
    if wanted:
        pages = {
            name: url
            for name, url in pages.items()
            if name.startswith("reference") or any(w in name.lower() for w in wanted)
        }
    gc.callbacks.append(_gc_watch)
    results: dict[str, Any] = {"nodes": args.nodes, "models": args.models, "runs": args.runs}
    for name, url in pages.items():
        anonymous = Client() if url == "/login/" else client
        _refresh(fleet)
        results[name] = _measure(anonymous, url, args.runs)
        r = results[name]
        print(
            f"{name:36s} p50 {r['p50_ms']:7.1f} ms  p95 {r['p95_ms']:7.1f} ms  "
            f"max {r['max_ms']:7.1f} ms  min {r['min_ms']:7.1f} ms  "
            f"CPU p50 {r['cpu_p50_ms']:7.1f} ms  {r['kb']:8.1f} KiB"
        )
    redis.flushdb()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
