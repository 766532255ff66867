"""Console page server time with 100 nodes and 500 models (issue 14; not a test).

Run: ``.venv/bin/python bench/console_pages.py`` from the repository root, with
``MIRBAD_REDIS_URL`` pointing at a Redis it may write a few thousand keys to (default
``redis://127.0.0.1:6379/15``; the keys are the status cache's and the telemetry
history's, removed at the end). It makes a fresh data directory under /tmp (SQLite,
migrated; ``--database-url`` for PostgreSQL), fills it with ``--nodes`` nodes (default
100) and ``--models`` models (default 500, one replica each, spread over the nodes),
a status record per node with telemetry and Ready instances, and an hour of 5 s
telemetry history per node, then renders each page ``--runs`` times (default 30)
through Django's test client as a logged-in operator: the whole server side (URL
resolution, middleware, sessions, database, Redis, templates), no network, and no
test instrumentation of the templates. Each page's gen-2 garbage collections during
its runs are counted beside its times (they are the slow outliers).

Beside them, in the same run, the reference: Django admin's node changelist (the same
100 nodes through Django's own code) and the login page (an almost empty template).
Prints p50, p95 and max per page in ms and ``--json FILE`` writes them; the target is
under 150 ms per page (docs/performance.md).
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


def _gpu(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "name": "H100",
        "memoryTotalBytes": 80 * 2**30,
        "memoryUsedBytes": 40 * 2**30,
        "utilizationPercent": 55.0,
    }


def _fill(nodes: int, models: int, history_steps: int = 720) -> tuple[str, int]:
    """The fleet: nodes with status and history, models placed one replica each."""
    import asyncio

    from django.contrib.auth import get_user_model

    from models_registry.models import ModelDefinition, Placement
    from nodes import status_cache, telemetry
    from nodes.models import Node

    now = time.time()
    fleet = [
        Node.objects.create(
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
    ]
    placements: dict[str, list[str]] = {n.node_id: [] for n in fleet}
    for j in range(models):
        node = fleet[j % nodes]
        model = ModelDefinition.objects.create(
            served_name=f"model-{j:03d}", source_folder=f"m{j}", source_file="m.gguf"
        )
        placement = Placement.objects.create(model=model, node=node)
        placements[node.node_id].append(placement.instance_id)
    samples: dict[str, dict[str, Any]] = {}
    for node in fleet:
        instances = {
            iid: {"instanceId": iid, "state": "Ready", "measured": {"bytes": 3 * 2**30}}
            for iid in placements[node.node_id]
        }
        sample: dict[str, Any] = {
            "cpuPercent": 42.0,
            "cpuPerCore": [40.0] * 16,
            "load": [2.0, 1.5, 1.0],
            "memory": {"totalBytes": 256 * 2**30, "usedBytes": 90 * 2**30, "percent": 35.0},
            "disks": [{"path": "/srv/models", "totalBytes": 2 * 2**40, "freeBytes": 2**40}],
            "gpus": [_gpu(g) for g in range(4)],
        }
        status_cache.write(
            {
                "nodeId": node.node_id,
                "state": "Online",
                "reasons": [],
                "lastSeen": now,
                "instances": instances,
                "telemetry": sample,
            }
        )
        samples[node.node_id] = sample

    async def history() -> None:
        # One event loop for all of it: the async Redis client is one per loop.
        for node_id, sample in samples.items():
            for step in range(history_steps):  # an hour at 5 s by default
                counters = 1000.0 + 50 * step
                sample["engines"] = [
                    {"instanceId": iid, "pid": 1, "cpuPercent": 90.0, "rssBytes": 3 * 2**30,
                     "metrics": {"requestsRunning": 1.0, "requestsWaiting": 0.0,
                                 "promptTokensTotal": counters, "generationTokensTotal": counters,
                                 "kvCacheUsageRatio": 0.2}}
                    for iid in placements[node_id]
                ]  # fmt: skip
                await telemetry.arecord(node_id, sample, now=now - 5 * (history_steps - step))

    asyncio.run(history())
    user = get_user_model().objects.create_user("bench", password="x", is_staff=True)  # noqa: S106
    user.is_superuser = True
    user.save()
    return fleet[0].node_id, ModelDefinition.objects.order_by("pk").first().pk  # type: ignore[union-attr]


_GC_PAUSES: list[tuple[int, float]] = []
_gc_started = [0.0]


def _gc_watch(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        _GC_PAUSES.append((info["generation"], (time.perf_counter() - _gc_started[0]) * 1000))


def _measure(client: Any, url: str, runs: int) -> dict[str, float]:
    times = []
    for _ in range(runs + 2):
        started = time.perf_counter()
        response = client.get(url)
        elapsed = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}")
        times.append(elapsed)
    times = times[2:]  # the first two warm caches (templates, connections)
    gen2 = [ms for gen, ms in _GC_PAUSES if gen == 2]
    _GC_PAUSES.clear()
    return {
        "gc_gen2_pauses": len(gen2),
        "gc_gen2_max_ms": round(max(gen2, default=0.0), 1),
        "p50_ms": round(statistics.median(times), 1),
        "p95_ms": round(_percentile(times, 95), 1),
        "max_ms": round(max(times), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--database-url", default="")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--history-steps", type=int, default=720, help="5 s points per node")
    parser.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the heap in the collector (mirbad_site/asgi.py freezes it at start)",
    )
    parser.add_argument("--profile", default="", help="cProfile this URL instead")
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
    node_id, model_id = _fill(args.nodes, args.models, args.history_steps)
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

        client.get(args.profile)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            client.get(args.profile)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        return
    pages = {
        "Overview /": "/",
        "Nodes /nodes/": "/nodes/",
        "Node page /nodes/<id>/": f"/nodes/{node_id}/",
        "Node history 1h": f"/nodes/{node_id}/history.json",
        "Node history 24h": f"/nodes/{node_id}/history.json?window=24h",
        "Models /models/": "/models/",
        "Model page /models/<id>/": f"/models/{model_id}/",
        "Downloads /downloads/": "/downloads/",
        "Usage /usage/": "/usage/",
        "Keys /keys/": "/keys/",
        "reference: admin node changelist": "/admin/nodes/node/",
        "reference: login page": "/login/",
    }
    gc.callbacks.append(_gc_watch)
    results: dict[str, Any] = {"nodes": args.nodes, "models": args.models, "runs": args.runs}
    for name, url in pages.items():
        anonymous = Client() if url == "/login/" else client
        results[name] = _measure(anonymous, url, args.runs)
        r = results[name]
        print(
            f"{name:36s} p50 {r['p50_ms']:7.1f} ms  p95 {r['p95_ms']:7.1f} ms  max {r['max_ms']:7.1f} ms"
        )
    redis.flushdb()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
