"""GET /api/usage over a month with 1,000 keys and 100 models (issue 18; not a test).

Run: ``.venv/bin/python bench/usage.py`` from the repository root (SQLite in a fresh
data directory under /tmp), or with ``--database-url postgresql://postgres@127.0.0.1:5432/x``
(a fresh database ``mirbad_bench_usage_<time>`` is made on that server and dropped at
the end). It fills the database with one month (November 2026) of metered usage:

- ``--keys`` keys (default 1,000) and ``--models`` served names (default 100);
- each key uses ``--models-per-key`` of them (default 5, spread so every model is used);
- each (key, model) has a row in ``--hours-per-day`` hours of each day (default 6,
  a block starting at an hour that depends on the key), so 1,000 x 5 x 6 x 30 =
  900,000 hourly rows, 150,000 day rows and 5,000 month rows.

The rows are written in bulk with the day and month rollups summed from the same
numbers (the meter's own path, ``router.usage.add_deltas``, adds row by row and is
tested in tests/router/test_usage_rollups.py). Then it times, as a logged-in operator
through Django's test client (URL, middleware, session, database, serializer, JSON):

- ``GET /api/usage?from=2026-11-01&to=2026-11-30`` (the calendar month: one month
  rollup read), ``--runs`` times (default 20);
- ``GET /api/usage`` from 2026-11-01T05:00Z to 2026-12-01T05:00Z (30 days from an
  hour: edge hours, days and no whole month), ``--runs`` times;
- the reference in the same run: the same month summed from the hourly rows alone
  (what /api/usage read before the rollups), as a service call, ``--reference-runs``
  times (default 5; it is the slow one), beside the rollup read as a service call.

Prints p50 / p95 / max in ms; writes ``bench/results/usage-<time>[-postgresql].json``.
The target is under 200 ms for the month (docs/performance.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, sys.path[0] is bench/; the repository root is what we import from.
sys.path[0] = str(ROOT)

RESULTS = ROOT / "bench" / "results"
MONTH = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
DAYS = 30
TARGET_MS = 200.0


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def _stats(times: list[float]) -> dict[str, float]:
    return {
        "runs": len(times),
        "p50_ms": round(statistics.median(times), 1),
        "p95_ms": round(_percentile(times, 95), 1),
        "max_ms": round(max(times), 1),
    }


def _fresh_postgres(url: str) -> tuple[str, Callable[[], None]]:
    """A new database on ``url``'s server; returns its URL and the call that drops it."""
    import psycopg

    name = f"mirbad_bench_usage_{int(time.time())}"
    base, _, _old = url.rpartition("/")
    admin = f"{base}/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')

    return f"{base}/{name}", drop


def _fill(keys: int, models: int, per_key: int, hours_per_day: int) -> dict[str, int]:
    """The month's rows in bulk; returns how many of each were written."""
    from django.db import transaction

    from router.models import ApiKey, UsageDay, UsageMonth, UsageRecord

    ApiKey.objects.bulk_create(
        [
            ApiKey(
                name=f"key-{i:04d}", prefix=f"mbd-{i:06d}", key_hash=f"{i:064x}", scopes=["chat"]
            )
            for i in range(keys)
        ],
        batch_size=2000,
    )
    rows = list(ApiKey.objects.order_by("pk").values_list("pk", "prefix"))
    names = [f"model-{m:03d}" for m in range(models)]
    counts = {"hourly": 0, "daily": 0, "monthly": 0}
    month = MONTH.date()
    for index, (key_id, prefix) in enumerate(rows):
        hourly: list[UsageRecord] = []
        daily: list[UsageDay] = []
        monthly: list[UsageMonth] = []
        first_hour = index % (24 - hours_per_day + 1)
        for j in range(per_key):
            model = names[(index * 7 + j * (models // per_key)) % models]
            total = [0, 0, 0, 0]
            for day in range(DAYS):
                day_sums = [0, 0, 0, 0]
                for h in range(first_hour, first_hour + hours_per_day):
                    # Numbers that differ by key, model, day and hour.
                    seed = index + j * 31 + day * 7 + h
                    c = (1 + seed % 9, 200 + seed % 500, 50 + seed % 300, seed % 11 == 0)
                    hour = MONTH + dt.timedelta(days=day, hours=h)
                    hourly.append(
                        UsageRecord(
                            key_id=key_id,
                            key_prefix=prefix,
                            model=model,
                            hour=hour,
                            requests=c[0],
                            prompt_tokens=c[1],
                            completion_tokens=c[2],
                            errors=int(c[3]),
                        )
                    )
                    for i in range(4):
                        day_sums[i] += int(c[i])
                daily.append(
                    UsageDay(
                        key_id=key_id,
                        key_prefix=prefix,
                        model=model,
                        day=month + dt.timedelta(days=day),
                        requests=day_sums[0],
                        prompt_tokens=day_sums[1],
                        completion_tokens=day_sums[2],
                        errors=day_sums[3],
                    )
                )
                for i in range(4):
                    total[i] += day_sums[i]
            monthly.append(
                UsageMonth(
                    key_id=key_id,
                    key_prefix=prefix,
                    model=model,
                    month=month,
                    requests=total[0],
                    prompt_tokens=total[1],
                    completion_tokens=total[2],
                    errors=total[3],
                )
            )
        with transaction.atomic():
            UsageRecord.objects.bulk_create(hourly, batch_size=5000)
            UsageDay.objects.bulk_create(daily, batch_size=5000)
            UsageMonth.objects.bulk_create(monthly, batch_size=5000)
        counts["hourly"] += len(hourly)
        counts["daily"] += len(daily)
        counts["monthly"] += len(monthly)
    return counts


def _hourly_only(start: dt.datetime, end: dt.datetime) -> list[dict[str, Any]]:
    """The reference: /api/usage's summary from the hourly rows alone (before rollups)."""
    from django.db.models import Sum

    from router.models import UsageRecord

    rows = (
        UsageRecord.objects.filter(hour__gte=start, hour__lt=end)
        .values("key_id", "key_prefix", "key__name", "model")
        .annotate(requests=Sum("requests"), prompt_tokens=Sum("prompt_tokens"),
                  completion_tokens=Sum("completion_tokens"), errors=Sum("errors"))
        .order_by("key_prefix", "model")
    )  # fmt: skip
    out: list[dict[str, Any]] = [dict(row) for row in rows]
    out.sort(key=lambda r: -(r["prompt_tokens"] + r["completion_tokens"]))
    return out


def _time(call: Callable[[], Any], runs: int) -> tuple[list[float], Any]:
    call()  # warm-up: connection, caches, imports
    times = []
    answer = None
    for _ in range(runs):
        started = time.perf_counter()
        answer = call()
        times.append((time.perf_counter() - started) * 1000)
    return times, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--models-per-key", type=int, default=5)
    parser.add_argument("--hours-per-day", type=int, default=6)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--reference-runs", type=int, default=5)
    parser.add_argument("--database-url", default="", help="a PostgreSQL server's URL")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    args = parser.parse_args()

    data = Path(tempfile.mkdtemp(prefix="mirbad-bench-usage-"))
    os.environ["MIRBAD_DATA_PATH"] = str(data)
    os.environ["MIRBAD_REDIS_URL"] = args.redis_url
    os.environ["MIRBAD_ALLOWED_HOSTS"] = "testserver"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")
    drop: Callable[[], None] = lambda: None  # noqa: E731
    engine = "sqlite"
    if args.database_url:
        url, drop = _fresh_postgres(args.database_url)
        os.environ["MIRBAD_DATABASE_URL"] = url
        engine = "postgresql"

    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client

    from router import usage

    try:
        call_command("migrate", verbosity=0)
        get_user_model().objects.create_superuser("bench", password="x")  # noqa: S106
        started = time.perf_counter()
        counts = _fill(args.keys, args.models, args.models_per_key, args.hours_per_day)
        fill_s = time.perf_counter() - started
        print(f"{engine}: filled {counts} in {fill_s:.0f} s")
        if engine == "postgresql":
            from django.db import connection

            with connection.cursor() as cursor:
                cursor.execute("ANALYZE")
        client = Client()
        client.login(username="bench", password="x")  # noqa: S106

        def get(params: dict[str, str]) -> Callable[[], Any]:
            def call() -> Any:
                response = client.get("/api/usage", params)
                assert response.status_code == 200, response.content[:200]
                return response.json()

            return call

        month = {"from": "2026-11-01", "to": "2026-11-30"}
        shifted = {"from": "2026-11-01T05:00:00Z", "to": "2026-12-01T05:00:00Z"}
        month_times, month_answer = _time(get(month), args.runs)
        shifted_times, shifted_answer = _time(get(shifted), args.runs)
        end = MONTH + dt.timedelta(days=DAYS)
        service_times, service_rows = _time(lambda: usage.usage_summary(MONTH, end), args.runs)
        reference_times, reference_rows = _time(
            lambda: _hourly_only(MONTH, end), args.reference_runs
        )
        same = sorted(
            (r["key_id"], r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"],
             r["errors"]) for r in service_rows
        ) == sorted(
            (r["key_id"], r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"],
             r["errors"]) for r in reference_rows
        )  # fmt: skip
        results: dict[str, Any] = {
            "meta": {
                "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "database": engine,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "keys": args.keys,
                "models": args.models,
                "models_per_key": args.models_per_key,
                "hours_per_day": args.hours_per_day,
                "rows": counts,
                "fill_s": round(fill_s, 1),
            },
            "GET /api/usage calendar month": {
                **_stats(month_times), "usage_rows": len(month_answer["usage"]),
            },
            "GET /api/usage 30 days from 05:00 UTC": {
                **_stats(shifted_times), "usage_rows": len(shifted_answer["usage"]),
            },
            "service: usage_summary (rollups)": _stats(service_times),
            "reference: the month from hourly rows only": _stats(reference_times),
            "same rows as the reference": same,
            "target_ms": TARGET_MS,
            "pass": _stats(month_times)["p95_ms"] < TARGET_MS
            and _stats(shifted_times)["p95_ms"] < TARGET_MS,
        }  # fmt: skip
        for name, value in results.items():
            if isinstance(value, dict) and "p50_ms" in value:
                print(f"{name:45s} p50 {value['p50_ms']:8.1f} ms  p95 {value['p95_ms']:8.1f} ms"
                      f"  max {value['max_ms']:8.1f} ms")  # fmt: skip
        print(f"same rows as the reference: {same}; under {TARGET_MS:g} ms: {results['pass']}")
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%MZ")
        suffix = "" if engine == "sqlite" else f"-{engine}"
        path = RESULTS / f"usage-{stamp}{suffix}.json"
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")
    finally:
        drop()


if __name__ == "__main__":
    main()
