"""Token budgets of a key per calendar day and month, in the key's time zone.

A key may carry ``daily_token_budget`` and ``monthly_token_budget`` (prompt +
completion tokens). What a key used is what ``router.usage`` metered, summed over
every web process: each process reads the key's period totals from the database
(hourly rows at the edges, day and month rollups between, ``usage.token_totals``)
in the background while the key is busy, and adds the tokens it metered itself
that the database may not hold yet (``UsageMeter.tokens``). Admission compares
those with the budgets: no query on the hot path, none at all for a key without a
budget. The first request of a key with a budget in a process waits for one read,
as a key's first lookup does.

A budget is a ceiling on starting requests: the request that crosses it finishes,
and each other web process sees the crossing within about a refresh (1 s) plus
the meter's flush (2 s), so a key may go over by what it spends in that time.

Periods are calendar days and months in ``budget_timezone``, their boundaries
rounded down to the UTC hour, because usage is kept per UTC hour: in a zone with a
half-hour offset (Asia/Kolkata) the budget's day begins at 23:30 local time
(docs/operator-guide.md, "Budgets"; /tmp/decisions_budgets.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import math
import time
import zoneinfo
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from router import errors, usage
from router.errors import V1Error
from router.keys import KeyInfo
from router.models import ApiKey
from router.usage import UsageMeter

log = logging.getLogger("mirbad.router.budgets")

REFRESH_INTERVAL = 1.0  # seconds between reads of a busy key's totals
BUSY_FOR = 10.0  # a key admitted this recently is busy: its totals are refreshed
FORGET_AFTER = 3600.0  # a key idle this long is dropped; its next request reads again
WARNING_SHARE = 0.8  # the share of a budget that shows a warning


@dataclass(frozen=True)
class Period:
    """One budget period: [start, end) in Unix seconds, both on a UTC hour."""

    kind: str  # "day" or "month"
    start: int
    end: int

    def retry_after(self, now: float) -> int:
        return max(1, math.ceil(self.end - now))

    def resets_at(self) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.end, tz=datetime.UTC)


@functools.lru_cache(maxsize=1024)
def _zone(name: str) -> datetime.tzinfo:
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        # router.keys refuses such a name; a row older than that check counts in UTC.
        return datetime.UTC


def _hour(moment: datetime.datetime) -> int:
    return int(moment.timestamp()) // 3600 * 3600


def _midnight(day: datetime.date, zone: datetime.tzinfo) -> datetime.datetime:
    return datetime.datetime.combine(day, datetime.time(), tzinfo=zone)


def _next_month(day: datetime.date) -> datetime.date:
    return (day.replace(day=1) + datetime.timedelta(days=32)).replace(day=1)


def periods(zone_name: str, now: float) -> tuple[Period, Period]:
    """The day and the month of ``zone_name`` that hold ``now``, on UTC hours.

    A boundary is rounded down to its UTC hour; from that hour on, the next period
    has begun (so every hourly row belongs to exactly one day and one month).
    """
    zone = _zone(zone_name)
    today = datetime.datetime.fromtimestamp(now, zone).date()
    day = _period("day", today, today + datetime.timedelta(days=1), zone)
    if now >= day.end:
        tomorrow = today + datetime.timedelta(days=1)
        day = _period("day", tomorrow, tomorrow + datetime.timedelta(days=1), zone)
    first = today.replace(day=1)
    month = _period("month", first, _next_month(first), zone)
    if now >= month.end:
        following = _next_month(first)
        month = _period("month", following, _next_month(following), zone)
    return day, month


def _period(kind: str, start: datetime.date, end: datetime.date, zone: datetime.tzinfo) -> Period:
    return Period(kind, _hour(_midnight(start, zone)), _hour(_midnight(end, zone)))


def _limits(key: KeyInfo | ApiKey) -> tuple[int | None, int | None]:
    return key.daily_token_budget, key.monthly_token_budget


@dataclass
class _State:
    """What one process knows of one key's use: totals read, and when."""

    key: KeyInfo
    seen: float
    # The periods the totals were read for; totals of other periods are unknown (0).
    day: Period | None = None
    month: Period | None = None
    day_total: int = 0
    month_total: int = 0
    # hour -> tokens of this process already written when the totals were read: the
    # read holds those; whatever this process recorded beyond them is added.
    base: dict[int, int] = field(default_factory=dict)


class Budgets:
    """Per-process admission by token budget, with totals refreshed in the background."""

    def __init__(
        self,
        meter: UsageMeter,
        *,
        clock: Callable[[], float] = time.time,
        interval: float = REFRESH_INTERVAL,
    ) -> None:
        self._meter = meter
        self._clock = clock
        self._interval = interval
        self._states: dict[int, _State] = {}
        self._loading: dict[int, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def admit(self, key: KeyInfo) -> None:
        """Refuse with ``429 budget_exceeded`` a key that used up a budget; else nothing.

        A key without budgets returns at once; one with budgets costs a dict lookup
        and a sum over this process's last hours (its first request: one read).
        """
        if key.daily_token_budget is None and key.monthly_token_budget is None:
            return
        state = self._states.get(key.id)
        if state is None:
            state = await self._first_read(key)
        now = self._clock()
        state.key, state.seen = key, now
        self._ensure_refreshing()
        refusal = self.refusal(key, now)
        if refusal is not None:
            raise refusal

    def used(self, key: KeyInfo, now: float) -> tuple[tuple[Period, int], tuple[Period, int]]:
        """(day, tokens used), (month, tokens used) as this process knows them now."""
        day, month = periods(key.budget_timezone, now)
        state = self._states.get(key.id)
        local = self._meter.tokens(key.id)
        out = []
        for period in (day, month):
            total = 0
            if state is not None:
                if period == state.day:
                    total = state.day_total
                elif period == state.month:
                    total = state.month_total
            base = state.base if state is not None else {}
            for hour, (recorded, _written) in local.items():
                if period.start <= hour < period.end:
                    total += recorded - base.get(hour, 0)
            out.append((period, total))
        return out[0], out[1]

    def refusal(self, key: KeyInfo, now: float) -> V1Error | None:
        """The ``budget_exceeded`` error when a budget of ``key`` is used up, else None."""
        day, month = self.used(key, now)
        over = [
            (period, used, limit)
            for (period, used), limit in zip((day, month), _limits(key), strict=True)
            if limit is not None and used >= limit
        ]
        if not over:
            return None
        # Over both: the later reset is the one that admits the key again.
        period, used, limit = max(over, key=lambda item: item[0].end)
        return errors.budget_exceeded(
            period.kind, used, limit, key.budget_timezone, period.resets_at(),
            period.retry_after(now),
        )  # fmt: skip

    async def refresh(self, keys: list[KeyInfo] | None = None) -> int:
        """Read the totals of ``keys`` (default: the busy ones) now; returns how many."""
        now = self._clock()
        if keys is None:
            for key_id in [k for k, s in self._states.items() if now - s.seen > FORGET_AFTER]:
                del self._states[key_id]
            keys = [s.key for s in self._states.values() if now - s.seen <= BUSY_FOR]
        if not keys:
            return 0
        bases = {key.id: {h: w for h, (_r, w) in self._meter.tokens(key.id).items()}
                 for key in keys}  # fmt: skip
        # Taken before the read: what was written by then is in what the read sees.
        totals = await sync_to_async(_read_totals, thread_sensitive=False)(keys, now)
        for key in keys:
            (day, day_total), (month, month_total) = totals[key.id]
            state = self._states.get(key.id)
            if state is None:
                state = self._states[key.id] = _State(key=key, seen=now)
            state.day, state.day_total = day, day_total
            state.month, state.month_total = month, month_total
            state.base = bases[key.id]
        return len(keys)

    async def _first_read(self, key: KeyInfo) -> _State:
        # One read per key however many of its requests arrive together.
        loading = self._loading.get(key.id)
        if loading is None:
            loading = asyncio.ensure_future(self._load(key))
            self._loading[key.id] = loading
            loading.add_done_callback(lambda _f: self._loading.pop(key.id, None))
        await asyncio.shield(loading)
        state = self._states.get(key.id)
        if state is None:  # the read failed: admit on what this process metered
            state = self._states[key.id] = _State(key=key, seen=self._clock())
        return state

    async def _load(self, key: KeyInfo) -> None:
        try:
            await self.refresh([key])
        except Exception as exc:
            log.warning("Budget totals of key %s not read, admitting: %r", key.prefix, exc)

    def _ensure_refreshing(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._loop(), name="budgets")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.refresh()
                self._failing = False
            except Exception as exc:
                if not self._failing:  # the first failure of a run, not every second
                    log.warning("Budget totals not read, keeping the last: %r", exc)
                self._failing = True
            if not self._states:
                return  # no key with a budget left; the next admission starts it again

    async def stop(self) -> None:
        """Stop the background refresh."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _read_totals(
    keys: list[KeyInfo], now: float
) -> dict[int, tuple[tuple[Period, int], tuple[Period, int]]]:
    """Each key's tokens in its current day and month from the database (a worker
    thread); keys of one zone share two queries."""
    close_old_connections()
    try:
        by_zone: dict[str, list[KeyInfo]] = {}
        for key in keys:
            by_zone.setdefault(key.budget_timezone, []).append(key)
        out = {}
        for zone, members in by_zone.items():
            day, month = periods(zone, now)
            ids = [key.id for key in members]
            days = usage.token_totals(_utc(day.start), _utc(day.end), ids)
            months = usage.token_totals(_utc(month.start), _utc(month.end), ids)
            for key in members:
                out[key.id] = ((day, days.get(key.id, 0)), (month, months.get(key.id, 0)))
        return out
    finally:
        close_old_connections()


def _utc(seconds: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)


# --- the budgets as /api/keys and the console show them ---------------------------------


def status(rows: Iterable[ApiKey], now: float | None = None) -> dict[int, dict[str, Any] | None]:
    """Per key id: None without budgets, else each period's limit, tokens used (from the
    database; the last seconds of metering may be missing) and reset time, and a
    warning from ``WARNING_SHARE`` of a budget on."""
    moment = time.time() if now is None else now
    budgeted = [row for row in rows if any(limit is not None for limit in _limits(row))]
    out: dict[int, dict[str, Any] | None] = {}
    by_zone: dict[str, list[ApiKey]] = {}
    for row in budgeted:
        by_zone.setdefault(row.budget_timezone, []).append(row)
    for zone, members in by_zone.items():
        day, month = periods(zone, moment)
        ids = [row.pk for row in members]
        days = usage.token_totals(_utc(day.start), _utc(day.end), ids)
        months = usage.token_totals(_utc(month.start), _utc(month.end), ids)
        for row in members:
            out[row.pk] = _row_status(
                row, (day, days.get(row.pk, 0)), (month, months.get(row.pk, 0))
            )
    return out


def _row_status(row: ApiKey, day: tuple[Period, int], month: tuple[Period, int]) -> dict[str, Any]:
    answer: dict[str, Any] = {"day": None, "month": None, "warning": None}
    warnings = []
    names = {"day": "daily", "month": "monthly"}
    for (period, used), limit in zip((day, month), _limits(row), strict=True):
        if limit is None:
            continue
        resets = period.resets_at()
        answer[period.kind] = {"limit": limit, "used": used, "resetsAt": resets}
        when = resets.strftime("%Y-%m-%d %H:%M UTC")
        if used >= limit:
            warnings.append(
                f"Over the {names[period.kind]} budget ({used} of {limit} tokens): "
                f"/v1 answers 429 budget_exceeded until {when}."
            )
        elif used >= WARNING_SHARE * limit:
            warnings.append(
                f"{used * 100 // limit} % of the {names[period.kind]} budget used "
                f"({used} of {limit} tokens); it resets at {when}."
            )
    answer["warning"] = " ".join(warnings) or None
    return answer
