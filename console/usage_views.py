"""The Usage page: requests and tokens per key and per model over a chosen range.

Thin: the range is read by router.usage.parse_range and the numbers are
router.usage.usage_summary's, the functions /api/usage and /api/usage.csv call, so
the page, the API and the CSV link (the same range, fixed at the page's render)
agree (docs/decisions.md D67).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlencode

from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.views.decorators.http import require_GET

from console.views import operator_required
from core.errors import ServiceError
from router import usage

PRESETS = {
    "1h": ("Last hour", datetime.timedelta(hours=1)),
    "24h": ("Last 24 hours", datetime.timedelta(hours=24)),
    "7d": ("Last 7 days", datetime.timedelta(days=7)),
    "30d": ("Last 30 days", datetime.timedelta(days=30)),
}
DEFAULT_PRESET = "24h"
# The chart has a bar per hour up to two days, a bar per day beyond; past a year the
# page refuses (the CSV has no such limit).
HOURLY_UP_TO = datetime.timedelta(hours=48)
LONGEST = datetime.timedelta(days=366)
_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "errors")


def chosen_range(
    params: QueryDict, now: datetime.datetime
) -> tuple[datetime.datetime, datetime.datetime, str]:
    """The [from, to) range the GET parameters ask for, and the preset (or "custom").

    ``from``/``to`` (dates or ISO times) win over ``range``; both are read by
    router.usage.parse_range, so they mean what they mean to /api/usage.
    """
    start, end = params.get("from", ""), params.get("to", "")
    if start or end:
        lower, upper = usage.parse_range(start or None, end or None, now=now)
        preset = "custom"
    else:
        preset = params.get("range") or DEFAULT_PRESET
        if preset not in PRESETS:
            raise ServiceError(
                400,
                "invalid_request",
                f"range: '{preset[:40]}' is not a range; choose one of "
                f"{', '.join(PRESETS)}, or give from/to dates",
            )
        since = (now - PRESETS[preset][1]).isoformat()
        lower, upper = usage.parse_range(since, None, now=now)
    if upper - lower > LONGEST:
        raise ServiceError(
            400,
            "invalid_request",
            "from, to: the page shows at most 366 days; narrow the range or download the CSV",
        )
    return lower, upper, preset


def _grouped(rows: Iterable[dict[str, Any]], by: tuple[str, ...]) -> list[dict[str, Any]]:
    """usage_summary's rows summed over the fields not in ``by``, most tokens first."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        group = groups.setdefault(
            tuple(row[f] for f in by), {**{f: row[f] for f in by}, **dict.fromkeys(_COUNTS, 0)}
        )
        for name in _COUNTS:
            group[name] += row[name]
    out = list(groups.values())
    out.sort(key=lambda g: (-(g["prompt_tokens"] + g["completion_tokens"]), str(g[by[-1]])))
    return out


def _series(lower: datetime.datetime, upper: datetime.datetime) -> dict[str, Any]:
    """Requests and tokens per hour (per day past two days), every bucket of the range."""
    hourly = upper - lower <= HOURLY_UP_TO
    step = datetime.timedelta(hours=1) if hourly else datetime.timedelta(days=1)
    first = lower if hourly else lower.replace(hour=0)
    buckets: dict[datetime.datetime, list[int]] = {}
    moment = first
    while moment < upper:
        buckets[moment] = [0, 0]
        moment += step
    for batch in usage.iter_usage_rows(lower, upper):
        for hour, _prefix, _name, _model, requests, prompt, completion, _errors in batch:
            at = datetime.datetime.fromisoformat(hour.replace("Z", "+00:00"))
            key = at if hourly else at.replace(hour=0)
            counts = buckets.setdefault(key, [0, 0])
            counts[0] += requests
            counts[1] += prompt + completion
    label = "%Y-%m-%d %H:00" if hourly else "%Y-%m-%d"
    return {
        "unit": "hour" if hourly else "day",
        "buckets": [
            {"label": at.strftime(label), "requests": c[0], "tokens": c[1]}
            for at, c in sorted(buckets.items())
        ],
    }


@operator_required
@require_GET
def usage_page(request: HttpRequest) -> HttpResponse:
    """The range picker, the per-key and per-model tables, a chart and the CSV link."""
    now = datetime.datetime.now(datetime.UTC)
    context: dict[str, Any] = {
        "presets": [(name, label) for name, (label, _) in PRESETS.items()],
        "from_value": request.GET.get("from", "")[:40],
        "to_value": request.GET.get("to", "")[:40],
    }
    try:
        lower, upper, preset = chosen_range(request.GET, now)
    except ServiceError as exc:
        context.update(error=exc.message, preset="")
        return render(request, "console/usage.html", context, status=exc.status)
    rows = usage.usage_summary(lower, upper)
    totals = {name: sum(row[name] for row in rows) for name in _COUNTS}
    context.update(
        preset=preset,
        start=lower,
        end=upper,
        by_key=_grouped(rows, ("key_id", "key_prefix", "key_name")),
        by_model=_grouped(rows, ("model",)),
        totals=totals,
        chart=_series(lower, upper),
        csv_url="/api/usage.csv?" + urlencode({"from": lower.isoformat(), "to": upper.isoformat()}),
    )
    return render(request, "console/usage.html", context)
