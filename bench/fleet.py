"""A fleet of hollow agents against a real master: monitor cost, freshness, restart, pages.

Run from the repository root (not a test; the figures go to docs/performance.md,
"A fleet of a thousand machines")::

    .venv/bin/python bench/fleet.py                  # 10, 100 and 1,000 nodes
    .venv/bin/python bench/fleet.py --quick          # 10 nodes, short windows (CI smoke)
    .venv/bin/python bench/fleet.py --sizes 10,100 --json /tmp/fleet.json

It starts ``mirbad up`` on PostgreSQL and Redis (``MIRBAD_DATABASE_URL`` and
``MIRBAD_REDIS_URL``, as CI has them; a fresh database and a Redis database it empties),
then grows the fleet size by size: each new node gets a join token from ``/api``, is
enrolled by a hollow agent (bench/hollow.py: the real agent with a stand-in engine
runtime, several hundred per worker process, each on its own 127.1.x.y address) and is
approved through ``/api``. Five models per node are defined through ``/api``, placed
across the nodes, and started. Nodes count the stack's own local agent: a size of
1,000 is 999 hollow nodes and ``local``. At each size it measures:

- the monitor's CPU over a steady window (all Online, all models Ready), and the
  resident memory of the monitor and of the web process;
- status freshness: models are stopped and started again through ``/api`` and, for
  each, the time from the instance's ``readyAt`` (the agent's clock: the same machine)
  to the moment the instance shows Ready in the node's record in Redis (polled every
  20 ms);
- ``GET /api/nodes`` and ``GET /api/models/{id}/placement-suggestions`` (wall time
  over loopback), and the console's Overview and Nodes pages (logged in, wall time);
- a killed hollow agent: seconds from its last contact to Offline in ``/api``;
- a master restart (``mirbad up`` stopped and started on the same data; the agents
  keep running): seconds from the start until every node is Online with a contact
  made after the start.

Loopback only and bounded: every wait has a deadline; the stack and the workers are
stopped at the end, whatever happened. ``--quick`` exits non-zero when a step fails or a
node never comes Online, so CI runs it as a smoke test; the targets are reported, not
asserted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _procs  # noqa: E402
from bench._fleet_report import render  # noqa: E402
from bench._paths import MirbadStack  # noqa: E402
from bench._tools import loud, say  # noqa: E402
from bench.hollow import Worker  # noqa: E402

MODELS_PER_NODE = 5
NODES_PER_WORKER = 250
# "app;dur=12.3, cpu;dur=4.5": the server's own wall and CPU milliseconds (ServerTimingMiddleware).
SERVER_TIMING = re.compile(r"(app|cpu);dur=([0-9.]+)")


def _pct(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))] if ordered else float("nan")
    )


def _iso_epoch(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def _wait(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> float:
    """Poll until ``predicate()`` is true; returns the seconds it took."""
    began = time.monotonic()
    deadline = began + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic() - began
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


class Fleet:
    """The stack, its hollow workers and the nodes and models made so far."""

    def __init__(self, *, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs = _procs.Processes(run_dir / "logs")
        env = {
            "MIRBAD_ENROLL_PORT": str(_procs.free_port()),
            "MIRBAD_AGENT_PORT": str(_procs.free_port()),
            # The answers carry the server's own wall and CPU time (timings()).
            "MIRBAD_SERVER_TIMING": "true",
        }
        self.stack = MirbadStack(self.procs, run_dir / "stack", external=True, env=env)
        self.workers: list[Worker] = []
        self.nodes: list[str] = ["local"]
        self.models: list[int] = []
        self.made = 0  # hollow nodes made so far (a killed one is not replaced by its name)
        self.placed: dict[int, str] = {}  # model id -> its node
        self.defined = 0  # models defined so far (their names count on)
        self.refused_starts = 0  # starts refused because the node was seen Offline
        self.port = _procs.free_port()
        self.http: httpx.Client | None = None
        self.console: httpx.Client | None = None
        self.password = ""
        self.redis = redis.Redis.from_url(os.environ["MIRBAD_REDIS_URL"])

    # -- the stack -------------------------------------------------------------------

    def start(self) -> None:
        self.stack.prepare()
        self.stack.start()
        self._clients()

    def _clients(self) -> None:
        for client in (self.http, self.console):
            if client is not None:
                client.close()
        self.http = httpx.Client(
            base_url=self.stack.url,
            headers={"Authorization": f"Bearer {self.stack.admin_key}"},
            timeout=120,
        )
        self.console = httpx.Client(base_url=self.stack.url, timeout=120, follow_redirects=True)
        admin = next(line for line in self.stack.lines if line.startswith("Admin: "))
        if admin != "Admin: unchanged":
            self.password = admin.split()[-1]
        login = self.console.get("/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text)
        if token is None:
            raise RuntimeError("the login page has no CSRF token")
        answer = self.console.post(
            "/login/",
            data={
                "username": "admin",
                "password": self.password,
                "csrfmiddlewaretoken": token.group(1),
            },
            headers={"Referer": self.stack.url + "/login/"},
        )
        if "sessionid" not in self.console.cookies:
            raise RuntimeError(f"console login failed ({answer.status_code})")

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        assert self.http is not None
        answer = self.http.request(method, path, **kwargs)
        if answer.status_code >= 300:
            raise RuntimeError(
                f"{method} {path} answered {answer.status_code}: {answer.text[:300]}"
            )
        return answer.json() if answer.content else None

    def pid(self, name: str) -> psutil.Process:
        return psutil.Process(self.stack.pid(name))

    def stop(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.stop()
        with contextlib.suppress(Exception):
            self.stack.stop()
        self.procs.stop_all()

    # -- growing -------------------------------------------------------------------------

    def grow(self, size: int) -> dict[str, Any]:
        """Enroll, approve and start models until the fleet has ``size`` nodes."""
        first = self.made
        self.made += size - len(self.nodes)
        new = [f"hollow-{i:04d}" for i in range(first, self.made)]
        began = time.monotonic()
        specs = []
        for i, node_id in enumerate(new, start=first):
            join = self.api("POST", "/api/join-tokens", json={"nodeId": node_id})
            specs.append(
                {
                    "nodeId": node_id,
                    "ip": f"127.1.{i // 250}.{i % 250 + 1}",
                    "port": self.port,
                    **join,
                }
            )
        for index in range(0, len(specs), NODES_PER_WORKER):
            chunk = specs[index : index + NODES_PER_WORKER]
            worker = Worker(
                folder=self.run_dir / "hollow",
                nodes=chunk,
                log_path=self.run_dir / "logs" / f"hollow-{len(self.workers)}.log",
                env={k: v for k, v in os.environ.items() if not k.startswith("MIRBAD_")},
            )
            worker.start(timeout=900)
            self.workers.append(worker)
        enrolled = time.monotonic() - began
        for node_id in new:
            self.api("POST", f"/api/nodes/{node_id}/approve")
        self.nodes += new
        online = _wait(self.all_online, 300, f"{size} nodes Online", interval=1.0)
        began = time.monotonic()
        hollow = self.nodes[1:]
        first_model = self.defined
        self.defined += MODELS_PER_NODE * len(hollow) - len(self.models)

        def define(j: int) -> int:
            model = self.api(
                "POST",
                "/api/models",
                json={
                    "servedName": f"fleet-{j:05d}",
                    "sourceFolder": "tiny",
                    "sourceFile": "tiny.gguf",
                    "settings": {"context_size": 256, "gpu_layers": 0},
                    "node": hollow[j % len(hollow)],
                },
            )
            self.placed[int(model["id"])] = hollow[j % len(hollow)]
            return int(model["id"])

        # A few at once, as an operator's script would: the web process serves requests
        # on several threads.
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            created = list(pool.map(define, range(first_model, self.defined)))
            defined = time.monotonic() - began
            began = time.monotonic()
            list(pool.map(self.start_model, created))
        self.models += created
        ready = _wait(self.all_ready, 900, f"{len(self.models)} models Ready", interval=1.0)
        return {
            "enrollAndStartSeconds": round(enrolled, 1),
            "onlineAfterApproveSeconds": round(online, 1),
            "modelsDefineSeconds": round(defined, 1),
            "modelsReadySeconds": round(time.monotonic() - began, 1),
            "modelsReadyWait": round(ready, 1),
            "startsRefusedNodeOffline": self.refused_starts,
        }

    def start_model(self, model_id: int, action: str = "start") -> None:
        """POST start (or stop); a node seen Offline for a moment (a flap) is retried and
        counted."""
        for _ in range(30):
            assert self.http is not None
            answer = self.http.post(f"/api/models/{model_id}/{action}")
            if answer.status_code < 300:
                return
            if answer.status_code != 503 or "node_not_serving" not in answer.text:
                raise RuntimeError(
                    f"starting model {model_id}: {answer.status_code} {answer.text[:300]}"
                )
            self.refused_starts += 1
            time.sleep(1.0)
        raise RuntimeError(f"model {model_id}: its node was not serving for 30 s")

    def flaps(self) -> int:
        """Online -> Offline transitions the monitor logged so far (none is expected but
        the killed node's: the others keep heartbeating)."""
        log = self.stack.data / "logs" / "monitor.log"
        return log.read_text(errors="replace").count(": Online -> Offline.") if log.exists() else 0

    def statuses(self) -> dict[str, dict[str, Any]]:
        keys = [f"mirbad:node:{n}" for n in self.nodes]
        out = {}
        for node_id, raw in zip(self.nodes, self.redis.mget(keys), strict=True):
            out[node_id] = json.loads(raw) if raw else {}
        return out

    def all_online(self, after: float | None = None) -> bool:
        """Every node of the fleet Online (with a contact after ``after``) in /api/nodes."""
        listed = {n["nodeId"]: n for n in self.api("GET", "/api/nodes")["nodes"]}
        return all(
            node_id in listed
            and listed[node_id]["state"] == "Online"
            and (after is None or (listed[node_id].get("lastSeen") or 0) > after)
            for node_id in self.nodes
        )

    def all_ready(self) -> bool:
        ready = 0
        for status in self.statuses().values():
            ready += sum(
                1 for i in (status.get("instances") or {}).values() if i.get("state") == "Ready"
            )
        return ready >= len(self.models)

    # -- measuring -------------------------------------------------------------------

    def steady(self, seconds: float) -> dict[str, Any]:
        """The monitor's and the web process's CPU over ``seconds`` of steady state."""
        monitor, web = self.pid("monitor"), self.pid("web")
        procs = {"monitor": [monitor], "web": [web, *web.children(recursive=True)]}
        before = {
            k: sum(p.cpu_times().user + p.cpu_times().system for p in v) for k, v in procs.items()
        }
        time.sleep(seconds)
        after = {
            k: sum(p.cpu_times().user + p.cpu_times().system for p in v) for k, v in procs.items()
        }
        return {
            "monitorCpuCores": round((after["monitor"] - before["monitor"]) / seconds, 3),
            "webCpuCores": round((after["web"] - before["web"]) / seconds, 3),
            "monitorRssBytes": monitor.memory_info().rss,
            "webRssBytes": max(p.memory_info().rss for p in procs["web"]),
            "workerRssBytes": [w.rss() for w in self.workers],
            "windowSeconds": seconds,
        }

    def freshness(self, samples: int) -> dict[str, Any]:
        """Stop and start ``samples`` models; readyAt (agent) to Ready in Redis, each."""
        chosen = self.models[:: max(1, len(self.models) // samples)][:samples]
        placed = {}
        for model_id in chosen:
            model = self.api("GET", f"/api/models/{model_id}")
            replica = model["placements"][0]
            placed[model_id] = (replica["node"], replica["instanceId"])
        for model_id in chosen:
            self.start_model(model_id, action="stop")
        _wait(
            lambda: all(
                (self._instance(*placed[m]) or {}).get("state") == "Stopped" for m in chosen
            ),
            120,
            "the sampled models Stopped",
        )
        # The starts go out from a thread while this one polls: a model that is Ready
        # while later starts are still being sent is seen at once, not after them.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        sending = pool.submit(lambda: [self.start_model(m) for m in chosen])
        seen: dict[int, float] = {}
        deadline = time.monotonic() + 120
        while len(seen) < len(chosen) and time.monotonic() < deadline:
            statuses = self.statuses()
            now = time.time()
            for model_id in chosen:
                if model_id in seen:
                    continue
                node, instance = placed[model_id]
                record = (statuses.get(node, {}).get("instances") or {}).get(instance) or {}
                if record.get("state") == "Ready" and record.get("readyAt"):
                    seen[model_id] = now - _iso_epoch(record["readyAt"])
            time.sleep(0.02)
        sending.result(timeout=600)
        pool.shutdown()
        lags = list(seen.values())
        return {
            "samples": len(chosen),
            "seen": len(lags),
            "p50": round(_pct(lags, 50), 3),
            "p99": round(_pct(lags, 99), 3),
            "max": round(max(lags), 3) if lags else None,
        }

    def _instance(self, node: str, instance: str) -> dict[str, Any] | None:
        raw = self.redis.get(f"mirbad:node:{node}")
        if not raw:
            return None
        found: dict[str, Any] | None = (json.loads(raw).get("instances") or {}).get(instance)
        return found

    def timings(self, runs: int) -> dict[str, Any]:
        """Wall times over loopback: /api/nodes, placement suggestions, two console pages;
        beside them the server's own time and CPU from each answer's Server-Timing. The
        web process shares two cores with the hollow nodes, the monitor, PostgreSQL and
        Redis: the CPU is what the answer cost, the wall what this machine made of it."""
        assert self.http is not None and self.console is not None
        model_id = self.models[len(self.models) // 2]
        urls = {
            "apiNodes": (self.http, "/api/nodes"),
            "suggest": (self.http, f"/api/models/{model_id}/placement-suggestions"),
            "overview": (self.console, "/"),
            "nodesPage": (self.console, "/nodes/"),
        }
        out = {}
        for name, (client, url) in urls.items():
            times, server, cpu = [], [], []
            for _ in range(runs + 2):
                began = time.perf_counter()
                answer = client.get(url)
                elapsed = time.perf_counter() - began
                if answer.status_code != 200:
                    raise RuntimeError(f"GET {url} answered {answer.status_code}")
                times.append(elapsed)
                spent = dict(SERVER_TIMING.findall(answer.headers.get("Server-Timing", "")))
                if set(spent) != {"app", "cpu"}:
                    raise RuntimeError(f"GET {url}: no Server-Timing (MIRBAD_SERVER_TIMING)")
                server.append(float(spent["app"]) / 1000)
                cpu.append(float(spent["cpu"]) / 1000)
            # The first two warm caches.
            times, server, cpu = times[2:], server[2:], cpu[2:]
            out[name] = {
                "p50": round(statistics.median(times), 4),
                "p95": round(_pct(times, 95), 4),
                "serverP50": round(statistics.median(server), 4),
                "cpuP50": round(statistics.median(cpu), 4),
                "cpuP95": round(_pct(cpu, 95), 4),
                "bytes": len(answer.content),
            }
        return out

    def kill_one(self) -> dict[str, Any]:
        """Kill the last hollow node; seconds from its last contact to Offline in /api."""
        node_id = self.nodes[-1]
        worker = next(w for w in self.workers if any(n["nodeId"] == node_id for n in w.nodes))
        killed_at = worker.kill_node(node_id)
        _wait(
            lambda: self.api("GET", f"/api/nodes/{node_id}")["state"] == "Offline",
            60,
            f"{node_id} Offline",
            interval=0.2,
        )
        shown = time.time()
        last = self.api("GET", f"/api/nodes/{node_id}")["lastSeen"]
        self.nodes.remove(node_id)
        self.models = [m for m in self.models if self.placed[m] != node_id]
        self.api("POST", f"/api/nodes/{node_id}/revoke")  # out of the fleet's checks
        return {
            "node": node_id,
            "offlineAfterLastContact": round(shown - last, 2),
            "lastContactBeforeKill": round(killed_at - last, 2),
        }

    def restart(self) -> dict[str, Any]:
        """``mirbad up`` stopped and started again; seconds until every node is Online."""
        assert self.stack.child is not None
        self.procs.stop(self.stack.child)
        stopped = time.time()
        time.sleep(1.0)
        began = time.time()
        self.stack.lines = []
        self.stack.start()
        up = time.time() - began
        self._clients()
        online = _wait(
            lambda: self.all_online(after=began),
            300,
            "every node Online after restart",
            interval=0.5,
        )
        return {
            "stopSeconds": round(began - stopped, 1),
            "upSeconds": round(up, 1),
            "allOnlineSeconds": round(time.time() - began, 1),
            "afterReadySeconds": round(online, 1),
        }


def measure(fleet: Fleet, size: int, quick: bool) -> dict[str, Any]:
    say(f"--- {size} nodes ---")
    result: dict[str, Any] = {"nodes": size}
    result["grow"] = fleet.grow(size)
    result["models"] = len(fleet.models)
    say(f"grown: {result['grow']}")
    time.sleep(3 if quick else 15)  # the start burst settles
    flaps = fleet.flaps()
    result["steady"] = fleet.steady(10 if quick else 60)
    say(f"steady: {result['steady']}")
    result["freshness"] = fleet.freshness(5 if quick else 100)
    say(f"freshness: {result['freshness']}")
    result["timings"] = fleet.timings(5 if quick else 30)
    say(f"timings: {result['timings']}")
    result["flaps"] = fleet.flaps() - flaps
    say(f"nodes that went Online -> Offline meanwhile: {result['flaps']}")
    result["kill"] = fleet.kill_one()
    say(f"kill: {result['kill']}")
    result["restart"] = fleet.restart()
    say(f"restart: {result['restart']}")
    return result


def _fresh_database() -> tuple[str, str] | None:
    """A database of its own on the configured PostgreSQL: (admin URL, new URL)."""
    url = os.environ.get("MIRBAD_DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        return None
    import psycopg

    name = f"mirbad_fleet_{os.getpid()}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urllib.parse.urlsplit(url)
    return url, urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="10,100,1000", help="fleet sizes, growing (default 10,100,1000)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="10 nodes, short windows: the CI smoke run"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args(argv)
    sizes = [10] if args.quick else [int(s) for s in args.sizes.split(",")]
    if sizes != sorted(sizes) or sizes[0] < 2 or sizes[-1] > 1000:
        parser.error("--sizes: growing sizes from 2 to 1000, e.g. 10,100,1000")
    for name in ("MIRBAD_DATABASE_URL", "MIRBAD_REDIS_URL"):
        if not os.environ.get(name):
            parser.error(f"{name} is not set: the fleet bench runs on PostgreSQL and Redis")
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the stack and the workers stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_dir = Path(tempfile.mkdtemp(prefix="mirbad-fleet-"))
    database = _fresh_database()
    saved = dict(os.environ)
    if database:
        os.environ["MIRBAD_DATABASE_URL"] = database[1]
    redis.Redis.from_url(os.environ["MIRBAD_REDIS_URL"]).flushdb()
    fleet = Fleet(run_dir=run_dir)
    results: list[dict[str, Any]] = []
    code = 0
    try:
        fleet.start()
        for size in sizes:
            results.append(measure(fleet, size, args.quick))
    except Exception as exc:
        loud(f"FLEET BENCH FAILED: {exc} (logs in {run_dir / 'logs'})")
        code = 1
    finally:
        fleet.stop()
        os.environ.clear()
        os.environ.update(saved)
        if database:
            import psycopg

            name = urllib.parse.urlsplit(database[1]).path.lstrip("/")
            with psycopg.connect(database[0], autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if results:
        table = render(results)
        print(table)
        if args.json:
            args.json.write_text(json.dumps({"results": results, "table": table}, indent=2))
    if code == 0 and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
