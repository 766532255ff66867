"""/api latency while console logins check passwords (issue 11 part 6; not a test).

Run: ``.venv/bin/python bench/logins.py`` from the repository root, with
``MIRBAD_REDIS_URL`` pointing at a Redis it may write a few keys to (the router's
listener and the login throttle use it). It starts one web process as ``./mirbad up``
runs it (uvicorn with ``mirbad_site.asgi:application``) on a fresh data directory
under /tmp (SQLite, migrated first), with one staff user and one ``admin`` key, then
measures ``GET /api/nodes`` with that key, one request at a time:

1. **idle**: nothing else runs;
2. **logins**: ``--logins`` clients (default 24) log in over and over meanwhile, each
   a GET of ``/login/`` and a POST of the form with the right password (a wrong one
   would be throttled after 10), so every login pays one PBKDF2 check.

It prints, per phase, the /api p50, p90 and max and the logins completed, and
``--json FILE`` writes them. Bounded: each phase lasts ``--seconds`` (default 10)
and at most ``MAX_PROBES`` /api requests; the server is stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _procs

ROOT = Path(__file__).resolve().parent.parent
MAX_PROBES = 5_000
PASSWORD = "bench-login-password-1"  # noqa: S105 - a throwaway user in a /tmp data dir
CSRF_RE = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')

SETUP = """
import django
django.setup()
from django.contrib.auth import get_user_model
from router import keys
get_user_model().objects.create_user("bench", password=%r, is_staff=True)
print(keys.create_key(name="bench", scopes=["admin"])[1])
"""


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


async def _probe(base: str, key: str, stop: asyncio.Event) -> list[float]:
    """Sequential GET /api/nodes until ``stop``; the latency of each, in ms."""
    out: list[float] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, timeout=60.0) as client:
        while not stop.is_set() and len(out) < MAX_PROBES:
            started = time.perf_counter()
            response = await client.get("/api/nodes", headers=headers)
            out.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"/api/nodes answered {response.status_code}: {response.text}")
    return out


async def _login_loop(base: str, stop: asyncio.Event, times: list[float]) -> None:
    """Log in over and over (a fresh CSRF token each time: a login rotates it)."""
    async with httpx.AsyncClient(base_url=base, timeout=120.0) as client:
        while not stop.is_set():
            started = time.perf_counter()
            page = await client.get("/login/")
            match = CSRF_RE.search(page.text)
            if match is None:
                raise RuntimeError(f"/login/ has no CSRF token ({page.status_code})")
            response = await client.post(
                "/login/",
                data={
                    "username": "bench",
                    "password": PASSWORD,
                    "csrfmiddlewaretoken": match.group(1),
                },
                headers={"Referer": base + "/login/"},
            )
            if response.status_code != 302:
                raise RuntimeError(f"login answered {response.status_code}: {response.text[:200]}")
            times.append((time.perf_counter() - started) * 1000)


async def _phase(base: str, key: str, seconds: float, logins: int) -> dict[str, Any]:
    stop = asyncio.Event()
    login_times: list[float] = []
    loops = [asyncio.create_task(_login_loop(base, stop, login_times)) for _ in range(logins)]
    if logins:
        await asyncio.sleep(min(3.0, seconds / 3))  # let the logins pile up first
    probe = asyncio.create_task(_probe(base, key, stop))
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    stop.set()
    latencies = await probe
    logins_in_window = len(login_times)  # includes the warm-up's: the rate is what counts
    await asyncio.gather(*loops)
    elapsed = time.perf_counter() - started
    return {
        "logins": logins,
        "api_requests": len(latencies),
        "api_p50_ms": round(statistics.median(latencies), 2),
        "api_p90_ms": round(_percentile(latencies, 90), 2),
        "api_max_ms": round(max(latencies), 2),
        "logins_done": logins_in_window,
        "logins_after_stop": len(login_times) - logins_in_window,
        "wind_down_s": round(elapsed - seconds, 1),
        "login_p50_ms": round(statistics.median(login_times), 1) if login_times else None,
    }


def _hash_ms() -> float:
    """One PBKDF2 check of Django's default cost in this process, for scale (best of 3)."""
    import hashlib

    from django.contrib.auth.hashers import PBKDF2PasswordHasher

    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        hashlib.pbkdf2_hmac("sha256", b"x", b"salt", PBKDF2PasswordHasher.iterations)
        best = min(best, time.perf_counter() - started)
    return round(best * 1000, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--logins", type=int, default=24, help="concurrent login clients")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if not os.environ.get("MIRBAD_REDIS_URL"):
        parser.error("set MIRBAD_REDIS_URL (a Redis the benchmark may write a few keys to)")
    if not 1 <= args.seconds <= 120 or not 1 <= args.logins <= 200:
        parser.error("--seconds must be 1-120 and --logins 1-200")

    work = Path(tempfile.mkdtemp(prefix="mirbad-bench-logins-"))
    port = _procs.free_port()
    env = {
        **os.environ,
        "MIRBAD_DATA_PATH": str(work),
        "MIRBAD_PORT": str(port),
        "MIRBAD_LOG_LEVEL": "WARNING",
        "DJANGO_SETTINGS_MODULE": "mirbad_site.settings",
    }
    env.pop("MIRBAD_DATABASE_URL", None)
    py = sys.executable
    subprocess.run([py, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    key = subprocess.run(
        [py, "-c", SETUP % PASSWORD],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    procs = _procs.Processes(work / "logs")
    base = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"cpus": os.cpu_count(), "seconds": args.seconds}
    results["pbkdf2_ms"] = _hash_ms()
    try:
        argv = [py, "-m", "uvicorn", "mirbad_site.asgi:application", "--port", str(port)]
        web = procs.spawn(
            "web",
            [*argv, "--no-access-log", "--lifespan", "on"],
            env=env,
            cwd=ROOT,
        )
        _procs.wait_until(
            lambda: _procs.http_status(base + "/login/") == 200,
            timeout=60,
            what="the web process",
            child=web,
        )
        results["idle"] = asyncio.run(_phase(base, key, args.seconds, 0))
        results["logins"] = asyncio.run(_phase(base, key, args.seconds, args.logins))
    finally:
        procs.stop_all()
    for name in ("idle", "logins"):
        r = results[name]
        print(
            f"{name:>6}: /api p50 {r['api_p50_ms']} ms, p90 {r['api_p90_ms']} ms, "
            f"max {r['api_max_ms']} ms over {r['api_requests']} requests; "
            f"{r['logins_done']} logins done (p50 {r['login_p50_ms']} ms) by {r['logins']} "
            f"clients, {r['logins_after_stop']} more in {r['wind_down_s']} s after"
        )
    print(f"one PBKDF2 check here: {results['pbkdf2_ms']} ms")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
