"""Usage rolled up per UTC day and month beside the hourly rows; reads that combine them;
retention of the hourly rows."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.db.models import Sum

from router import keys, usage
from router.models import UsageDay, UsageMonth, UsageRecord
from router.usage import UsageMeter

pytestmark = pytest.mark.django_db

UTC = dt.UTC


def _at(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


def _seed() -> tuple[Any, Any]:
    a, _ = keys.create_key(name="a", scopes=["chat"])
    b, _ = keys.create_key(name="b", scopes=["chat"])
    deltas: dict[usage.Bucket, usage.Counts] = {}
    moment = _at(2026, 9, 28, 0)
    step = 0
    # Every 7 hours from late September to early December, two keys, two models.
    while moment < _at(2026, 12, 3):
        key = a if step % 3 else b
        model = "m1" if step % 2 else "m2"
        deltas[(key.pk, key.prefix, model, int(moment.timestamp()))] = (
            1 + step % 4, 10 + step, step % 5, step % 2,
        )  # fmt: skip
        moment += dt.timedelta(hours=7)
        step += 1
    # A key deleted since: its usage stays under its prefix.
    deltas[(10**9, "mbd-gone", "m1", int(_at(2026, 11, 15, 3).timestamp()))] = (2, 30, 3, 0)
    usage.add_deltas(deltas)
    return a, b


def _reference(start: dt.datetime, end: dt.datetime) -> list[dict[str, Any]]:
    """The summary from the hourly rows alone (what /api/usage answered before rollups)."""
    rows = (
        UsageRecord.objects.filter(hour__gte=start, hour__lt=end)
        .values("key_id", "key_prefix", "key__name", "model")
        .annotate(
            requests=Sum("requests"), prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"), errors=Sum("errors"),
        )
    )  # fmt: skip
    out = [
        {"key_id": r["key_id"], "key_prefix": r["key_prefix"], "key_name": r["key__name"] or "",
         "model": r["model"], "requests": r["requests"], "prompt_tokens": r["prompt_tokens"],
         "completion_tokens": r["completion_tokens"], "errors": r["errors"]}
        for r in rows
    ]  # fmt: skip
    return sorted(out, key=lambda r: (r["key_prefix"], r["model"]))


def _sorted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["key_prefix"], r["model"]))


def test_rollups_hold_the_sums_of_their_hours() -> None:
    _seed()
    for table, column, trunc in ((UsageDay, "day", "day"), (UsageMonth, "month", "month")):
        for row in table.objects.all():
            first = getattr(row, column)
            start = dt.datetime.combine(first, dt.time(), tzinfo=UTC)
            if trunc == "day":
                end = start + dt.timedelta(days=1)
            else:
                end = dt.datetime.combine(
                    (first + dt.timedelta(days=32)).replace(day=1), dt.time(), tzinfo=UTC
                )
            where = {"model": row.model, "hour__gte": start, "hour__lt": end}
            where.update({"key_id": row.key_id} if row.key_id else {"key_prefix": row.key_prefix})
            sums = UsageRecord.objects.filter(**where).aggregate(
                r=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"),
                e=Sum("errors"),
            )  # fmt: skip
            assert (row.requests, row.prompt_tokens, row.completion_tokens, row.errors) == (
                sums["r"], sums["p"], sums["c"], sums["e"],
            )  # fmt: skip
    assert UsageMonth.objects.filter(month=dt.date(2026, 10, 1)).exists()
    assert UsageDay.objects.filter(key=None, key_prefix="mbd-gone").count() == 1


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (_at(2026, 10, 1), _at(2026, 11, 1)),  # one whole month
        (_at(2026, 9, 28, 5), _at(2026, 12, 2, 13)),  # edge hours, days, two months, days
        (_at(2026, 10, 31, 22), _at(2026, 11, 1, 3)),  # hours only, across a month
        (_at(2026, 11, 3), _at(2026, 11, 9)),  # days only
        (_at(2026, 11, 3, 7), dt.datetime(2026, 11, 3, 9, 30, tzinfo=UTC)),  # a partial hour
    ],
)
def test_summary_from_rollups_equals_the_hourly_rows(start: dt.datetime, end: dt.datetime) -> None:
    _seed()
    got = usage.usage_summary(start, end)
    end_hour = end.replace(minute=0) + (dt.timedelta(hours=1) if end.minute else dt.timedelta())
    assert _sorted(got) == _reference(start, end_hour)
    assert got == sorted(got, key=lambda r: -(r["prompt_tokens"] + r["completion_tokens"]))
    a = keys.ApiKey.objects.get(name="a")
    a_only = usage.usage_summary(start, end, key_id=a.pk, model="m1")
    assert a_only == [
        r for r in _reference(start, end_hour) if (r["key_id"], r["model"]) == (a.pk, "m1")
    ]


def test_a_month_is_read_from_its_rollup_not_its_hours() -> None:
    _seed()
    UsageRecord.objects.filter(hour__gte=_at(2026, 10, 1), hour__lt=_at(2026, 11, 1)).delete()
    got = usage.usage_summary(_at(2026, 10, 1), _at(2026, 11, 1))
    assert (
        sum(r["requests"] for r in got)
        == UsageMonth.objects.filter(month=dt.date(2026, 10, 1)).aggregate(n=Sum("requests"))["n"]
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after")
async def test_the_meters_flush_writes_the_rollups() -> None:
    from asgiref.sync import sync_to_async

    _, plaintext = await sync_to_async(keys.create_key)(
        name="k", scopes=["chat"], daily_token_budget=10**6
    )
    info = await sync_to_async(keys.lookup)(plaintext)
    assert info is not None
    clock = [_at(2026, 11, 30, 23, 30).timestamp()]
    meter = UsageMeter(clock=lambda: clock[0])
    meter.record(info, "m", prompt_tokens=5, completion_tokens=1)
    clock[0] = _at(2026, 12, 1, 0, 30).timestamp()  # the next day and month
    meter.record(info, "m", prompt_tokens=7, completion_tokens=2)
    meter.record(info, "m", prompt_tokens=1, completion_tokens=1)
    await meter.flush()
    days = await sync_to_async(
        lambda: list(
            UsageDay.objects.order_by("day").values_list("day", "requests", "prompt_tokens")
        )
    )()
    months = await sync_to_async(
        lambda: list(UsageMonth.objects.order_by("month").values_list("month", "completion_tokens"))
    )()
    assert days == [(dt.date(2026, 11, 30), 1, 5), (dt.date(2026, 12, 1), 2, 8)]
    assert months == [(dt.date(2026, 11, 1), 1), (dt.date(2026, 12, 1), 3)]
    assert meter.tokens(info.id) == {
        int(_at(2026, 11, 30, 23).timestamp()): (6, 6),
        int(_at(2026, 12, 1, 0).timestamp()): (11, 11),
    }


def test_pruning_drops_old_hours_and_keeps_the_rollups() -> None:
    _seed()
    now = _at(2026, 12, 2, 12)
    before = usage.usage_summary(_at(2026, 10, 1), _at(2026, 11, 1))
    assert usage.prune_hourly(keep_days=40, now=now) > 0
    oldest = UsageRecord.objects.order_by("hour").first()
    assert oldest is not None and oldest.hour >= _at(2026, 10, 23)  # whole days: 40 days back
    assert UsageMonth.objects.filter(month=dt.date(2026, 9, 1)).exists()
    assert usage.usage_summary(_at(2026, 10, 1), _at(2026, 11, 1)) == before
    # Budgets read the current month's hours: fewer than 32 days are never pruned.
    usage.prune_hourly(keep_days=1, now=now)
    assert UsageRecord.objects.filter(hour__lt=_at(2026, 11, 1)).exists()
    assert not UsageRecord.objects.filter(hour__lt=_at(2026, 10, 31)).exists()


def test_the_prune_task_uses_the_setting(settings: Any) -> None:
    import dataclasses

    from router import tasks

    _seed()
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, usage_hourly_keep_days=33)
    cutoff = (dt.datetime.now(UTC) - dt.timedelta(days=33)).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    old = UsageRecord.objects.filter(hour__lt=cutoff).count()
    assert old > 0
    assert tasks.prune_usage_hours() == old
    assert not UsageRecord.objects.filter(hour__lt=cutoff).exists()
    assert UsageDay.objects.filter(day__lt=cutoff.date()).exists()


def test_usage_items_are_the_serializers_rows() -> None:
    from router.api.serializers import UsageRowSerializer, usage_items

    _seed()
    rows = usage.usage_summary(_at(2026, 9, 1), _at(2026, 12, 31))
    assert len(rows) > 3
    expected = UsageRowSerializer(rows, many=True).data  # type: ignore[arg-type]
    assert json.dumps(usage_items(rows)) == json.dumps(expected)


def test_any_range_equals_the_hourly_rows() -> None:
    """Random ranges (a fixed seed) over the seeded months: the signed pieces of
    ``usage.spans`` (rollups, hours added and subtracted) always give the hourly sums."""
    import random

    a, b = _seed()
    chance = random.Random(18)
    first, last = _at(2026, 9, 20), _at(2026, 12, 6)
    hours = int((last - first).total_seconds() // 3600)
    for _ in range(60):
        lo, hi = sorted(chance.sample(range(hours), 2))
        start = first + dt.timedelta(hours=lo)
        end = first + dt.timedelta(hours=hi)
        assert _sorted(usage.usage_summary(start, end)) == _reference(start, end), (start, end)
        expected = {r["key_id"]: 0 for r in _reference(start, end) if r["key_id"] in (a.pk, b.pk)}
        for r in _reference(start, end):
            if r["key_id"] in expected:
                expected[r["key_id"]] += r["prompt_tokens"] + r["completion_tokens"]
        assert usage.token_totals(start, end, [a.pk, b.pk]) == {
            k: v for k, v in expected.items() if v
        }


def test_the_migration_rolls_up_the_hours_written_before_it() -> None:
    import importlib

    from django.apps import apps

    backfill = importlib.import_module("router.migrations.0005_usage_rollups").backfill
    a, _ = _seed()
    UsageDay.objects.all().delete()
    UsageMonth.objects.all().delete()
    backfill(apps, None)
    start, end = _at(2026, 9, 28, 5), _at(2026, 12, 2, 13)
    assert _sorted(usage.usage_summary(start, end)) == _reference(start, end)
    november = UsageMonth.objects.filter(month=dt.date(2026, 11, 1), key=a)
    assert november.exists()
