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
from router.models import ApiKey, UsageRecord

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
        with self._lock:
            self._last_used[key.id] = now
            self._add_locked(
                (key.id, key.prefix, model, now // 3600 * 3600), 1, prompt, completion, 0
            )

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
            return len(snapshot)

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
    """Add the deltas to their rows in one transaction (runs in a worker thread)."""
    close_old_connections()
    try:
        key_ids = {bucket[0] for bucket in deltas}
        # A key deleted since the request keeps its usage, under its prefix only.
        existing = set(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", flat=True))
        with transaction.atomic():
            for (key_id, prefix, model, hour_ts), counts in sorted(deltas.items()):
                hour = datetime.datetime.fromtimestamp(hour_ts, tz=datetime.UTC)
                _add(key_id if key_id in existing else None, prefix, model, hour, counts)
    finally:
        close_old_connections()


def _add(
    key_id: int | None, prefix: str, model: str, hour: datetime.datetime, counts: Counts
) -> None:
    where: dict[str, Any] = {"key_id": key_id, "model": model, "hour": hour}
    if key_id is None:
        where["key_prefix"] = prefix
    increments = {
        "requests": F("requests") + counts[0],
        "prompt_tokens": F("prompt_tokens") + counts[1],
        "completion_tokens": F("completion_tokens") + counts[2],
        "errors": F("errors") + counts[3],
    }
    if UsageRecord.objects.filter(**where).update(**increments):
        return
    try:
        with transaction.atomic():  # a savepoint: another process may create it first
            UsageRecord.objects.create(
                key_id=key_id,
                key_prefix=prefix,
                model=model,
                hour=hour,
                requests=counts[0],
                prompt_tokens=counts[1],
                completion_tokens=counts[2],
                errors=counts[3],
            )
    except IntegrityError:
        UsageRecord.objects.filter(**where).update(**increments)


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


def usage_summary(
    start: datetime.datetime,
    end: datetime.datetime,
    key_id: int | None = None,
    model: str | None = None,
) -> list[dict[str, Any]]:
    """Requests and tokens in [start, end) per key and served name, largest first."""
    rows = (
        _records(start, end, key_id, model)
        .values("key_id", "key_prefix", "key__name", "model")
        .annotate(
            requests=Sum("requests"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            errors=Sum("errors"),
        )
        .order_by("key_prefix", "model")
    )
    out = [
        {
            "key_id": row["key_id"],
            "key_prefix": row["key_prefix"],
            "key_name": row["key__name"] or "",
            "model": row["model"],
            "requests": row["requests"],
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "errors": row["errors"],
        }
        for row in rows
    ]
    out.sort(key=lambda r: -(r["prompt_tokens"] + r["completion_tokens"]))
    return out


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
