"""Usage metering per key, served name and UTC hour; summaries and CSV export.

The router calls ``UsageMeter.record`` once per proxied request (a dict update
in memory, no I/O), and the meter writes the accumulated deltas to
``UsageRecord`` every 2 s with atomic increments, so several web processes add
into the same rows. A flush subtracts only what it wrote: increments recorded
while it ran stay for the next flush, and a failed flush leaves everything for
the next try. (A commit that succeeds but whose acknowledgement is lost would
be written again on retry; the database does not tell the two apart, and the
window is one round trip.) While the database is away, the deltas stay in
memory, one entry per key, model and hour.

Reading ``usage`` out of responses is ``router.transform``'s job
(``StreamFilter``, ``UsageSniffer``); the router passes the numbers here.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import datetime
import io
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import F, Q, Sum
from django.utils.dateparse import parse_date, parse_datetime

from core.errors import ServiceError
from router.keys import KeyInfo
from router.models import ApiKey, UsageDay, UsageMonth, UsageRecord

log = logging.getLogger("mirbad.router.usage")

FLUSH_INTERVAL = 2.0
DEFAULT_RANGE = datetime.timedelta(hours=24)
CSV_HEADER = (
    "hour",
    "key_prefix",
    "key_name",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "errors",
)
_BATCH = 2000
# Budgets in any zone read the current month's edge hours from the hourly rows
# (router.budgets): hours this recent are never pruned, whatever the setting says.
MIN_HOURLY_KEEP_DAYS = 32

# (key id, key prefix, served name, hour start as Unix seconds)
Bucket = tuple[int, str, str, int]
# requests, prompt tokens, completion tokens, errors
Counts = tuple[int, int, int, int]
_FIELDS = 4


class UsageMeter:
    """Per-process accumulator of usage, flushed to the database in the background."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, interval: float = FLUSH_INTERVAL
    ) -> None:
        self._clock = clock
        self._interval = interval
        self._pending: dict[Bucket, list[int]] = {}
        self._last_used: dict[int, int] = {}  # key id -> Unix seconds of its latest request
        # key id -> hour -> [tokens recorded, tokens written]: what router.budgets adds
        # to the totals it read, for the tokens the database may not hold yet.
        self._tokens: dict[int, dict[int, list[int]]] = {}
        # record() may be called from any thread; the lock is uncontended on the hot path.
        self._lock = threading.Lock()
        self._flush_lock = asyncio.Lock()  # one flush at a time, or two would write one delta
        self._task: asyncio.Task[None] | None = None

    def record(
        self, key: KeyInfo, model: str, *, prompt_tokens: int = 0, completion_tokens: int = 0
    ) -> None:
        """Count one request of ``key`` on served name ``model`` and its tokens (no I/O)."""
        now = int(self._clock())
        prompt = prompt_tokens if prompt_tokens > 0 else 0
        completion = completion_tokens if completion_tokens > 0 else 0
        hour = now // 3600 * 3600
        with self._lock:
            self._last_used[key.id] = now
            self._add_locked((key.id, key.prefix, model, hour), 1, prompt, completion, 0)
            if (prompt or completion) and key.budgeted:  # only budgets read the tally
                tally = self._tokens.setdefault(key.id, {}).setdefault(hour, [0, 0])
                tally[0] += prompt + completion

    def record_error(self, key: KeyInfo, model: str) -> None:
        """Count one request already recorded as an error (its answer was >= 400 or an
        error inside a 200 stream; the same rule as the router's errors metric)."""
        now = int(self._clock())
        with self._lock:
            self._add_locked((key.id, key.prefix, model, now // 3600 * 3600), 0, 0, 0, 1)

    def _add_locked(self, bucket: Bucket, *deltas: int) -> None:
        counts = self._pending.get(bucket)
        if counts is None:
            self._pending[bucket] = list(deltas)
        else:
            for i, delta in enumerate(deltas):
                counts[i] += delta

    def tokens(self, key_id: int) -> dict[int, tuple[int, int]]:
        """Per hour (Unix seconds) of ``key_id``: tokens recorded by this process and
        tokens of those written to the database, both counted since the process began
        (hours long written are forgotten)."""
        with self._lock:
            hours = self._tokens.get(key_id)
            return {h: (t[0], t[1]) for h, t in hours.items()} if hours else {}

    def pending(self) -> dict[Bucket, Counts]:
        """What has not been written yet (a copy)."""
        with self._lock:
            return {b: (c[0], c[1], c[2], c[3]) for b, c in self._pending.items()}

    async def flush(self) -> int:
        """Write the deltas recorded so far; returns how many rows it touched.

        Raises what the database raised; nothing is lost then, the next flush
        writes it. Cancelling the caller does not cancel a write under way: the
        write and the subtraction of what it wrote finish together, or the
        next flush would write the same deltas again.
        """
        return await asyncio.shield(self._flush())

    async def _flush(self) -> int:
        async with self._flush_lock:
            snapshot = self.pending()
            with self._lock:
                used = dict(self._last_used)
            if not snapshot and not used:
                return 0
            await sync_to_async(_write, thread_sensitive=False)(snapshot, used)
            with self._lock:
                for key_id, moment in used.items():
                    if self._last_used.get(key_id) == moment:
                        del self._last_used[key_id]
                for bucket, written in snapshot.items():
                    counts = self._pending[bucket]
                    for i in range(_FIELDS):
                        counts[i] -= written[i]
                    if not any(counts):
                        del self._pending[bucket]
                    tally = self._tokens.get(bucket[0], {}).get(bucket[3])
                    if tally is not None:
                        tally[1] += written[1] + written[2]
                self._forget_written_locked()
            return len(snapshot)

    def _forget_written_locked(self) -> None:
        # An hour fully written two hours ago is in every later read of the database.
        old = int(self._clock()) // 3600 * 3600 - 7200
        for key_id in list(self._tokens):
            hours = self._tokens[key_id]
            for hour in [h for h, t in hours.items() if h < old and t[0] == t[1]]:
                del hours[hour]
            if not hours:
                del self._tokens[key_id]

    def start(self) -> None:
        """Flush every ``interval`` seconds until ``stop()``."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="usage-meter")

    async def stop(self) -> None:
        """Stop the background flush and flush once more."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self.flush()
        except Exception:
            log.exception("Usage of %d key/model/hour buckets was not written", len(self._pending))

    async def _loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
                failing = False
            except Exception as exc:
                if not failing:  # log the first failure of a run, not every 2 s
                    log.warning("Usage flush failed, keeping the deltas to retry: %r", exc)
                failing = True


def _write(deltas: dict[Bucket, Counts], used: dict[int, int]) -> None:
    write_deltas(deltas)
    mark_used(used)


def mark_used(used: dict[int, int]) -> None:
    """Move each key's ``last_used_at`` forward to its latest request (never back).

    Several web processes write the same keys; the condition keeps the latest.
    """
    close_old_connections()
    try:
        for key_id, moment in sorted(used.items()):
            at = datetime.datetime.fromtimestamp(moment, tz=datetime.UTC)
            ApiKey.objects.filter(pk=key_id).filter(
                Q(last_used_at__isnull=True) | Q(last_used_at__lt=at)
            ).update(last_used_at=at)
    finally:
        close_old_connections()


def write_deltas(deltas: dict[Bucket, Counts]) -> None:
    """``add_deltas`` in a worker thread, on a connection fit for it."""
    close_old_connections()
    try:
        add_deltas(deltas)
    finally:
        close_old_connections()


def add_deltas(deltas: dict[Bucket, Counts]) -> None:
    """Add the deltas to their hourly rows and to the day and month rollups, in one
    transaction: a reader never sees an hour without its day."""
    key_ids = {bucket[0] for bucket in deltas}
    # A key deleted since the request keeps its usage, under its prefix only.
    existing = set(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", flat=True))
    days: dict[tuple[int | None, str, str, datetime.date], list[int]] = {}
    with transaction.atomic():
        for (key_id, prefix, model, hour_ts), counts in sorted(deltas.items()):
            hour = datetime.datetime.fromtimestamp(hour_ts, tz=datetime.UTC)
            owner = key_id if key_id in existing else None
            _add(UsageRecord, "hour", owner, prefix, model, hour, counts)
            sums = days.setdefault((owner, prefix, model, hour.date()), [0] * _FIELDS)
            for i in range(_FIELDS):
                sums[i] += counts[i]
        months: dict[tuple[int | None, str, str, datetime.date], list[int]] = {}
        for (owner, prefix, model, day), sums in sorted(days.items(), key=_order):
            _add(UsageDay, "day", owner, prefix, model, day, _counts(sums))
            month = months.setdefault((owner, prefix, model, day.replace(day=1)), [0] * _FIELDS)
            for i in range(_FIELDS):
                month[i] += sums[i]
        for (owner, prefix, model, first), sums in sorted(months.items(), key=_order):
            _add(UsageMonth, "month", owner, prefix, model, first, _counts(sums))


def _order(item: tuple[tuple[int | None, str, str, datetime.date], list[int]]) -> tuple[Any, ...]:
    # One order of row updates in every process, so that two flushes never deadlock;
    # None (a deleted key) sorts first.
    (owner, prefix, model, at), _ = item
    return (owner is not None, owner or 0, prefix, model, at)


def _counts(sums: list[int]) -> Counts:
    return (sums[0], sums[1], sums[2], sums[3])


def _add(
    table: type[UsageRecord] | type[UsageDay] | type[UsageMonth],
    column: str,
    key_id: int | None,
    prefix: str,
    model: str,
    at: datetime.datetime | datetime.date,
    counts: Counts,
) -> None:
    where: dict[str, Any] = {"key_id": key_id, "model": model, column: at}
    if key_id is None:
        where["key_prefix"] = prefix
    increments = {
        "requests": F("requests") + counts[0],
        "prompt_tokens": F("prompt_tokens") + counts[1],
        "completion_tokens": F("completion_tokens") + counts[2],
        "errors": F("errors") + counts[3],
    }
    rows = table.objects.filter(**where)
    if rows.update(**increments):
        return
    try:
        with transaction.atomic():  # a savepoint: another process may create it first
            table.objects.create(
                key_id=key_id,
                key_prefix=prefix,
                model=model,
                requests=counts[0],
                prompt_tokens=counts[1],
                completion_tokens=counts[2],
                errors=counts[3],
                **{column: at},
            )
    except IntegrityError:
        rows.update(**increments)


def prune_hourly(*, keep_days: int, now: datetime.datetime | None = None) -> int:
    """Delete hourly rows older than ``keep_days`` (at least ``MIN_HOURLY_KEEP_DAYS``);
    the day and month rollups stay. Returns the rows deleted."""
    keep = max(keep_days, MIN_HOURLY_KEEP_DAYS)
    cutoff = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(days=keep)
    # Whole UTC days only: a day is read either from its hours or from its rollup.
    cutoff = cutoff.replace(hour=0, minute=0, second=0, microsecond=0)
    deleted, _ = UsageRecord.objects.filter(hour__lt=cutoff).delete()
    if deleted:
        log.info("Pruned %d hourly usage rows before %s", deleted, cutoff.isoformat())
    return deleted


# --- reading usage back ---------------------------------------------------------------


def _moment(name: str, raw: str | None, *, end: bool) -> datetime.datetime | None:
    if raw is None or raw == "":
        return None
    try:
        # A bare day first: parse_datetime would read "2026-12-01" as its midnight.
        day = parse_date(raw) if len(raw) == 10 else None
        moment = None if day else parse_datetime(raw)
    except ValueError:
        day = moment = None
    if moment is not None:
        return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)
    if day is None:
        raise ServiceError(
            400,
            "invalid_request",
            f"{name}: '{raw}' is not an ISO 8601 date (2026-12-01) or time (2026-12-01T10:00:00Z)",
        )
    # A day as the end of a range includes that whole day.
    midnight = datetime.datetime.combine(day, datetime.time(), tzinfo=datetime.UTC)
    return midnight + datetime.timedelta(days=1) if end else midnight


def parse_range(
    start: str | None, end: str | None, *, now: datetime.datetime | None = None
) -> tuple[datetime.datetime, datetime.datetime]:
    """The [from, to) range of a usage query; the 24 hours up to now by default.

    Usage is kept per hour, so the range covers every hour it touches: ``from``
    is rounded down to its hour.
    """
    upper = _moment("to", end, end=True) or (now or datetime.datetime.now(datetime.UTC))
    lower = _moment("from", start, end=False) or upper - DEFAULT_RANGE
    lower = lower.replace(minute=0, second=0, microsecond=0)
    if lower >= upper:
        raise ServiceError(400, "invalid_request", "from: must be before to")
    return lower, upper


def parse_key_id(raw: str | None) -> int | None:
    """The ``key`` query parameter: a key id, or None for every key."""
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise ServiceError(400, "invalid_request", f"key: '{raw}' is not a key id (a number)")
    return int(raw)


def _records(
    start: datetime.datetime, end: datetime.datetime, key_id: int | None, model: str | None
) -> Any:
    records = UsageRecord.objects.filter(hour__gte=start, hour__lt=end)
    if key_id is not None:
        records = records.filter(key_id=key_id)
    if model:
        records = records.filter(model=model)
    return records


_SUMS = ("requests", "prompt_tokens", "completion_tokens", "errors")


def _ceil_hour(moment: datetime.datetime) -> datetime.datetime:
    floor = moment.replace(minute=0, second=0, microsecond=0)
    return floor if floor == moment else floor + datetime.timedelta(hours=1)


def _day(moment: datetime.datetime, *, up: bool) -> datetime.datetime:
    floor = moment.replace(hour=0)
    return floor + datetime.timedelta(days=1) if up and floor != moment else floor


def _month(moment: datetime.datetime, *, up: bool) -> datetime.datetime:
    floor = moment.replace(day=1, hour=0)
    if up and floor != moment:
        return (floor + datetime.timedelta(days=32)).replace(day=1)
    return floor


# One signed piece of a range: (level, start, end, +1 or -1); level 0 hours, 1 days,
# 2 months.
_Piece = tuple[int, datetime.datetime, datetime.datetime, int]
_LEVEL_HOURS = (1, 24, 24 * 30)


def _net(pieces: list[_Piece]) -> list[_Piece]:
    """The signed pieces of each level with overlaps cancelled (a sweep per level)."""
    out: list[_Piece] = []
    for level in range(3):
        changes: dict[datetime.datetime, int] = {}
        for lvl, lo, hi, sign in pieces:
            if lvl == level and lo != hi:
                changes[lo] = changes.get(lo, 0) + sign
                changes[hi] = changes.get(hi, 0) - sign
        count, since = 0, None
        for moment in sorted(changes):
            if count and since is not None:
                out.append((level, since, moment, count))
            count += changes[moment]
            since = moment
    return out


def _cost(pieces: list[_Piece], now: datetime.datetime) -> float:
    # Rows read: about one per key and model per unit of a level, none in the future;
    # and a query per level and sign.
    rows = 0.0
    for level, lo, hi, _sign in pieces:
        past = min(hi, max(lo, now)) - lo
        rows += past.total_seconds() / 3600 / _LEVEL_HOURS[level]
    return rows + 2 * len({(p[0], p[3]) for p in pieces})


def spans(
    start: datetime.datetime, end: datetime.datetime, *, now: datetime.datetime | None = None
) -> list[tuple[Any, int]]:
    """[start, end) as signed queries over the hourly rows and the day and month rollups:
    (queryset, +1 or -1), unfiltered by key or model.

    The hours counted are those that start in [start, end) (``start`` rounded down to
    its hour), as the hourly rows alone counted them. Each edge of the range is reached
    from a month boundary (the one before it or after it) by whole days, then by hours
    (before or after); of those choices the one reading the fewest rows is taken, so
    30 days from 05:00 is a month's rollup less five hours plus five hours, not 29 day
    rows per key and model.
    """
    a = start.astimezone(datetime.UTC).replace(minute=0, second=0, microsecond=0)
    b = _ceil_hour(end.astimezone(datetime.UTC))
    moment = (now or datetime.datetime.now(datetime.UTC)).astimezone(datetime.UTC)
    best: list[_Piece] | None = None
    best_cost = 0.0
    for choice in range(16):
        ups = [bool(choice & bit) for bit in (1, 2, 4, 8)]
        month_a, month_b = _month(a, up=ups[0]), _month(b, up=ups[1])
        day_a, day_b = _day(a, up=ups[2]), _day(b, up=ups[3])
        pieces = _net(
            [
                _signed(2, month_a, month_b, 1),
                _signed(1, month_b, day_b, 1),
                _signed(1, month_a, day_a, -1),
                _signed(0, day_b, b, 1),
                _signed(0, day_a, a, -1),
            ]
        )
        cost = _cost(pieces, moment)
        if best is None or cost < best_cost:
            best, best_cost = pieces, cost
    assert best is not None
    return _queries(best)


def _signed(level: int, frm: datetime.datetime, to: datetime.datetime, sign: int) -> _Piece:
    return (level, frm, to, sign) if to >= frm else (level, to, frm, -sign)


def _queries(pieces: list[_Piece]) -> list[tuple[Any, int]]:
    out: list[tuple[Any, int]] = []
    for level, table, column in ((0, UsageRecord, "hour"), (1, UsageDay, "day"),
                                 (2, UsageMonth, "month")):  # fmt: skip
        # Usually +1 and -1; two pieces of one level may overlap (2).
        for sign in sorted({p[3] for p in pieces if p[0] == level}):
            where = Q()
            for lvl, lo, hi, s in pieces:
                if lvl == level and s == sign:
                    low, high = (lo, hi) if level == 0 else (lo.date(), hi.date())
                    where |= Q(**{f"{column}__gte": low, f"{column}__lt": high})
            if where:
                out.append((table.objects.filter(where), sign))
    return out


def usage_summary(
    start: datetime.datetime,
    end: datetime.datetime,
    key_id: int | None = None,
    model: str | None = None,
) -> list[dict[str, Any]]:
    """Requests and tokens in [start, end) per key and served name, largest first.

    Whole months and days come from the rollups, only the edge hours from the hourly
    rows (``spans``), so a month costs about one row per key and model.
    """
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for records, sign in spans(start, end):
        if key_id is not None:
            records = records.filter(key_id=key_id)
        if model:
            records = records.filter(model=model)
        rows = (
            records.order_by()
            .values_list("key_id", "key_prefix", "key__name", "model")
            .annotate(*(Sum(name) for name in _SUMS))
        )
        for owner, prefix, name, served, *sums in rows:
            row = merged.get((owner, prefix, served))
            if row is None:
                row = merged[(owner, prefix, served)] = {
                    "key_id": owner,
                    "key_prefix": prefix,
                    "key_name": name or "",
                    "model": served,
                    **dict.fromkeys(_SUMS, 0),
                }
            for field, value in zip(_SUMS, sums, strict=True):
                row[field] += sign * int(value)
    # A key and model with usage only in what was subtracted nets to nothing; a row of
    # the hourly table always has a request or an error, so nothing real is dropped.
    kept = [r for r in merged.values() if any(r[name] for name in _SUMS)]
    out = sorted(kept, key=lambda r: (r["key_prefix"], r["model"], r["key_id"] or 0))
    out.sort(key=lambda r: -(r["prompt_tokens"] + r["completion_tokens"]))
    return out


def token_totals(
    start: datetime.datetime, end: datetime.datetime, key_ids: list[int]
) -> dict[int, int]:
    """Prompt + completion tokens in [start, end) per key id (the keys with none are
    left out); the same hours, days and months as ``usage_summary``."""
    totals: dict[int, int] = {}
    for records, sign in spans(start, end):
        rows = (
            records.filter(key_id__in=key_ids)
            .order_by()
            .values_list("key_id")
            .annotate(Sum("prompt_tokens"), Sum("completion_tokens"))
        )
        for owner, prompt, completion in rows:
            totals[owner] = totals.get(owner, 0) + sign * (int(prompt or 0) + int(completion or 0))
    return {owner: total for owner, total in totals.items() if total}


def iter_usage_rows(
    start: datetime.datetime,
    end: datetime.datetime,
    key_id: int | None = None,
    model: str | None = None,
    *,
    batch: int = _BATCH,
) -> Iterator[list[tuple[Any, ...]]]:
    """Hourly rows in CSV column order, in batches (keyset pagination, no open cursor)."""
    records = _records(start, end, key_id, model).order_by("hour", "id")
    after: tuple[datetime.datetime, int] | None = None
    while True:
        page = records
        if after is not None:
            page = page.filter(Q(hour__gt=after[0]) | Q(hour=after[0], id__gt=after[1]))
        found = list(
            page.values_list(
                "hour",
                "id",
                "key_prefix",
                "key__name",
                "model",
                "requests",
                "prompt_tokens",
                "completion_tokens",
                "errors",
            )[:batch]
        )
        if not found:
            return
        after = (found[-1][0], found[-1][1])
        yield [
            (
                hour.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                prefix,
                name or "",
                served,
                requests,
                prompt,
                completion,
                errors,
            )
            for hour, _id, prefix, name, served, requests, prompt, completion, errors in found
        ]
        if len(found) < batch:
            return


def _cell(value: Any) -> Any:
    # A name starting with = + - @ would be a formula in a spreadsheet.
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@"):
        return "'" + value
    return value


def csv_lines(rows: list[tuple[Any, ...]], *, header: bool = False) -> str:
    """Rows as CSV text, cells that a spreadsheet would run as formulas defused."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    if header:
        writer.writerow(CSV_HEADER)
    writer.writerows([[_cell(v) for v in row] for row in rows])
    return buffer.getvalue()


def usage_csv(
    start: datetime.datetime,
    end: datetime.datetime,
    key_id: int | None = None,
    model: str | None = None,
) -> Iterator[str]:
    """The CSV export, header first, a batch of lines at a time."""
    yield csv_lines([], header=True)
    for rows in iter_usage_rows(start, end, key_id, model):
        yield csv_lines(rows)


async def ausage_csv(
    start: datetime.datetime,
    end: datetime.datetime,
    key_id: int | None = None,
    model: str | None = None,
) -> AsyncIterator[str]:
    """``usage_csv`` for an ASGI response: each batch is read in Django's sync thread."""
    batches = iter_usage_rows(start, end, key_id, model)
    next_batch = sync_to_async(lambda: next(batches, None))
    yield csv_lines([], header=True)
    while (rows := await next_batch()) is not None:
        yield csv_lines(rows)
