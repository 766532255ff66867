"""A ``Server-Timing`` header with the time the server spent on an answer.

``app``: wall time from the first middleware in to the answer out (a streamed
answer: to its head); ``cpu``: the CPU the
serving thread used meanwhile. On a machine shared with other work the first grows
with the neighbours and the second does not: bench/fleet.py reports both
(docs/performance.md). On only with ``MIRBAD_SERVER_TIMING=true``: it tells any caller,
before or without a login, how long the server worked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from django.http import HttpRequest, HttpResponseBase


class ServerTimingMiddleware:
    """Sync only: the whole chain and the view then run on one thread, which is the
    thread whose CPU time is read."""

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        wall, cpu = time.perf_counter(), time.thread_time()
        response = self.get_response(request)  # rendered: Django renders templates inside
        app = (time.perf_counter() - wall) * 1000
        used = (time.thread_time() - cpu) * 1000
        response["Server-Timing"] = f"app;dur={app:.1f}, cpu;dur={used:.1f}"
        return response
