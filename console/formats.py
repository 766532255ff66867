"""How the console prints values; console/static/console/live.js prints them the same way."""

from __future__ import annotations

import datetime as dt


def gib(value: object) -> float | None:
    """Bytes as GiB, None when unknown (the template prints a dash)."""
    return value / 2**30 if isinstance(value, int | float) and not isinstance(value, bool) else None


def when(iso: str | None) -> str:
    """'2026-12-02 18:35 UTC' (the console's one way to print a time)."""
    return f"{iso[:10]} {iso[11:16]} UTC" if iso else ""


def age_text(seconds: float) -> str:
    """'12 s ago', '4 min ago', '3 h ago', '2 d ago'."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} d ago"


def iso_epoch(iso: object) -> float | None:
    """The epoch seconds of an ISO 8601 time (``Z`` or an offset), None when it is none."""
    if not isinstance(iso, str) or not iso:
        return None
    try:
        moment = dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)).timestamp()
