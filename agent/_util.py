"""Time stamps in the contract's format."""

from __future__ import annotations

import time
from datetime import UTC, datetime

__all__ = ["iso_time", "utc_now_iso"]


def iso_time(timestamp: float) -> str:
    """A UNIX time as the contract's ISO 8601 form: ``2026-12-01T08:00:00.123Z``."""
    moment = datetime.fromtimestamp(timestamp, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def utc_now_iso() -> str:
    """The current time in the contract's ISO 8601 form."""
    return iso_time(time.time())
