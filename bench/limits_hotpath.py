"""Micro-benchmark of the limiter's per-request cost: µs per admit + release (not a test).

Run: ``.venv/bin/python bench/limits_hotpath.py`` (Redis from ``MIRBAD_REDIS_URL``, as
the router uses it; the keys it writes are deleted afterwards). ``--limits FILE`` times
another version of router/limits.py instead (e.g. one saved from an older commit), for
before/after figures. Three cases:

- a key with very high limits (rpm 1e9, tpm 2e9, concurrency 1e5, as bench/router.py
  uses): one request at a time, and 32 at a time on one event loop;
- a key with middling limits (rpm 60 000, concurrency 50), where blocks are small;
- a key without limits, the floor (no Redis at all).

Each line gives, per request (admit + release), the wall time and the CPU time of this
process (best of a few rounds; the wall time includes waiting for Redis, the CPU time
is what a web process pays), and the Redis commands, counted on the client (a pipeline
counts as one). Short on purpose: a few seconds of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")

import django

django.setup()

import redis.asyncio as aioredis  # noqa: E402
from django.conf import settings  # noqa: E402

from router import limits  # noqa: E402
from router.keys import KeyInfo  # noqa: E402

ROUNDS = 5
SEQUENTIAL = 2_000
CONCURRENT_TASKS = 32
PER_TASK = 100


class CountingRedis(aioredis.Redis):
    """Counts the round trips asked of it: each command, and each pipeline as one."""

    calls = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls += 1
        return await super().execute_command(*args, **options)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().pipeline(*args, **kwargs)


def _key(**limits: int) -> KeyInfo:
    return KeyInfo(
        id=2 * 10**9 + secrets.randbelow(10**9),
        prefix="mbd-bench",
        scopes=frozenset({"chat"}),
        model_allowlist=frozenset(),
        expires_at=None,
        **limits,
    )


async def _sequential(limiter: Any, key: KeyInfo, n: int) -> None:
    for _ in range(n):
        ticket = await limiter.admit(key)
        await limiter.release(ticket, tokens=300)


async def _concurrent(limiter: Any, key: KeyInfo, tasks: int, per_task: int) -> None:
    async def one() -> None:
        for _ in range(per_task):
            ticket = await limiter.admit(key)
            await asyncio.sleep(0)  # the request "runs": others admit meanwhile
            await limiter.release(ticket, tokens=300)

    await asyncio.gather(*(one() for _ in range(tasks)))


async def _case(
    module: Any, label: str, client: CountingRedis, key: KeyInfo, concurrent: bool
) -> None:
    limiter = module.Limiter(redis=client)
    limiter.start()
    n = CONCURRENT_TASKS * PER_TASK if concurrent else SEQUENTIAL
    try:
        await _sequential(limiter, key, 50)  # warm: script loaded, connections open
        wall = cpu = float("inf")
        calls_before = client.calls
        for _ in range(ROUNDS):
            started, started_cpu = time.perf_counter(), time.process_time()
            if concurrent:
                await _concurrent(limiter, key, CONCURRENT_TASKS, PER_TASK)
            else:
                await _sequential(limiter, key, n)
            wall = min(wall, time.perf_counter() - started)
            cpu = min(cpu, time.process_time() - started_cpu)
        calls = (client.calls - calls_before) / (n * ROUNDS)
    finally:
        await limiter.stop()
    print(
        f"{label:<50} {wall / n * 1e6:7.1f} µs wall {cpu / n * 1e6:7.1f} µs CPU "
        f"{calls:7.4f} Redis calls"
    )


def _load(path: str | None) -> Any:
    if path is None:
        return limits
    spec = importlib.util.spec_from_file_location("limits_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--limits", help="a router/limits.py to time instead of this one")
    module = _load(parser.parse_args().limits)
    client = CountingRedis.from_url(settings.MIRBAD.redis_url)
    big = {"rpm_limit": 10**9, "tpm_limit": 2 * 10**9, "concurrency_limit": 10**5}
    middling = {"rpm_limit": 60_000, "concurrency_limit": 50}
    try:
        await client.ping()
        cases = [
            ("no limits", {}, False),
            ("rpm 1e9, tpm 2e9, concurrency 1e5, 1 at a time", big, False),
            ("rpm 1e9, tpm 2e9, concurrency 1e5, 32 at a time", big, True),
            ("rpm 60000, concurrency 50, 1 at a time", middling, False),
            ("rpm 60000, concurrency 50, 32 at a time", middling, True),
        ]
        for label, limits_of_key, concurrent in cases:
            await _case(module, label, client, _key(**limits_of_key), concurrent)
    finally:
        async for name in client.scan_iter("mirbad:rl:{2*"):
            await client.delete(name)
        await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
