"""Requests finished in the last minute, for the Overview's "requests per minute" tile.

Sixty one-second slots: recording is one list write on the hot path (no lock, no Redis),
reading sums the slots still inside the minute. The count is this process's; the router
runs as one process (docs/architecture.md "Processes").
"""

from __future__ import annotations

import time

WINDOW_SECONDS = 60


class RecentRequests:
    """A ring of per-second request counts covering the last minute."""

    def __init__(self) -> None:
        self._seconds = [0] * WINDOW_SECONDS
        self._counts = [0] * WINDOW_SECONDS

    def record(self, now: float | None = None) -> None:
        second = int(time.time() if now is None else now)
        slot = second % WINDOW_SECONDS
        if self._seconds[slot] != second:
            self._seconds[slot], self._counts[slot] = second, 0
        self._counts[slot] += 1

    def last_minute(self, now: float | None = None) -> int:
        second = int(time.time() if now is None else now)
        return sum(
            count
            for at, count in zip(self._seconds, self._counts, strict=True)
            if second - WINDOW_SECONDS < at <= second
        )


recent = RecentRequests()
