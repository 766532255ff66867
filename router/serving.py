"""Serving one /v1 request on its candidates: the fair queue, load on demand, fallbacks.

router/app.py authenticates the key, reads the body and resolves ``model`` to its
candidates (one served name's route, or an alias's targets in order,
models_registry.routes); :meth:`Serving.serve` then finds the candidate that takes the
request and a replica of it:

- **Which candidate**: the first that can take a request now (a replica taking traffic
  and room in its fair queue); when none can, the first that loads on demand is started
  and waited for (router.ondemand), else the first is tried so that its own error
  (maintenance, offline, not ready) is the client's. A served name that does not load
  on demand goes straight to its one route.
- **Which replica**: a free slot from the model's fair queue (router.queue), at once or
  after a wait; with the queue off or Redis away, the routing table's pick.
- **Retries**: a failure before the first byte of the answer (``RetryableBeforeFirstByte``,
  raised by the proxy) tries another replica once, then the next candidate; a request
  that a later candidate took is logged and counted (``mirbad_v1_route_fallbacks_total``).

The proxy that sends the request to a replica and streams the answer back stays in
router/app.py (``RouterApp._proxy``); it is handed in, so this module does not import
the app.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.jsoninput import JSON_ERRORS
from router import errors, metrics, ondemand, transform
from router import queue as queue_mod
from router.errors import V1Error
from router.keys import KeyInfo
from router.queue import FairQueue
from router.relay import Receive, Send
from router.routing import Replica, Route, RoutingTable

log = logging.getLogger("mirbad.router")

Scope = dict[str, Any]
Usage = tuple[int, int]  # (prompt tokens, completion tokens) seen in an answer

SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each line on at once
]


@dataclass(slots=True)
class Request:
    """What the metrics need to know about one request, filled in as it goes."""

    started: float
    model: str = "unknown"
    key_prefix: str = "none"
    status: int = 200
    error_code: str | None = None
    ttfb: float | None = None
    overhead: float | None = None
    usage: Usage | None = None
    key: KeyInfo | None = None  # set once the request is metered, with the name it used
    metered_as: str = ""
    queue_wait: float | None = None  # seconds in the fair queue, once a slot was granted
    stream: bool = False  # the body asked for "stream": true
    # 200 text/event-stream was sent while a load on demand waited (router.ondemand): the
    # answer continues that stream, and an error ends it as one SSE error event.
    sse_started: bool = False


class RetryableBeforeFirstByte(Exception):
    """The replica failed before any byte of the answer reached the client: another
    replica, or the next candidate, may take the request. ``error`` is the client's
    answer when none does."""

    def __init__(self, error: V1Error) -> None:
        super().__init__(error.message)
        self.error = error


# Sends the request to one replica and streams the answer back; returns the usage seen.
Proxy = Callable[
    [Scope, Receive, Send, Replica, dict[bytes, bytes], transform.Prepared, Request],
    Awaitable[Usage | None],
]


class Serving:
    """The serving loop of one router process, over its routing table, its fair queue
    (``queue`` gives the one of the running event loop) and its proxy."""

    def __init__(self, table: RoutingTable, queue: Callable[[], FairQueue], proxy: Proxy) -> None:
        self.table = table
        self.queue = queue
        self.proxy = proxy

    async def serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        key: KeyInfo,
        name: str,
        candidates: list[Route],
        headers: dict[bytes, bytes],
        body: bytes,
        data: dict[str, Any],
        request: Request,
    ) -> Usage | None:
        """Serve one request on the first candidate that can take it; returns the usage.

        ``candidates`` is one served name's route, or an alias's targets in order
        (models_registry.routes). The first that can take the request now is used; when
        none can, the first that loads on demand is loaded, else the first is tried so
        that its own error (maintenance, offline, not ready) is the client's. A failure
        before the first byte on every replica of a target moves on to the next target.
        """
        start = 0
        # A served name that does not load on demand starts at its one route whatever the
        # answer: no look ahead on the common path.
        if len(candidates) > 1 or candidates[0].load_on_demand:
            for index, candidate in enumerate(candidates):
                if await self._can_take(candidate):
                    start = index
                    break
            else:
                loader = next((c for c in candidates if c.load_on_demand), None)
                if loader is not None:
                    await self._load_on_demand(loader, scope, send, request)
                    start = candidates.index(loader)
        failed: list[tuple[str, str]] = []  # (target, why) of targets tried and left
        last: V1Error = errors.model_not_ready(name)
        for index in range(start, len(candidates)):
            route = candidates[index]
            more = index + 1 < len(candidates)
            if index > start and not await self._can_take(route):
                failed.append((route.served_name, "cannot take a request now"))
                continue
            try:
                usage = await self._serve_on(scope, receive, send, key, name, route, headers,
                                             body, data, request, more=more)  # fmt: skip
            except RetryableBeforeFirstByte as exc:
                if not more:
                    raise exc.error from None
                last = exc.error
                failed.append((route.served_name, exc.error.message))
                continue
            except V1Error:
                if index > 0:  # a later target answered, with its error
                    await self._fell_back(name, candidates[:index], failed, route)
                raise
            if index > 0:
                await self._fell_back(name, candidates[:index], failed, route)
            return usage
        raise last

    async def _serve_on(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        key: KeyInfo,
        name: str,
        route: Route,
        headers: dict[bytes, bytes],
        body: bytes,
        data: dict[str, Any],
        request: Request,
        *,
        more: bool,
    ) -> Usage | None:
        """One candidate: a replica from the fair queue (router.queue), then the proxy; a
        failure before the first byte tries another replica, then raises
        ``RetryableBeforeFirstByte`` (``more``: a later candidate may take it)."""
        request.model = route.served_name
        if route.served_name != name:  # an alias's target, served under its own name
            body, data = transform.with_model(data, route.served_name)
        prepared = transform.prepare(
            scope["path"], body, emulate_dimensions=route.emulate_dimensions, data=data
        )
        tried: set[str] = set()
        last: RetryableBeforeFirstByte | None = None
        for attempt in range(2):
            try:
                replica, release = await self._slot(route, key, tried, receive, request)
            except V1Error:
                if last is None or not more:
                    raise
                raise last from None  # no other replica now: the next candidate may take it
            tried.add(replica.instance_id)
            try:
                return await self.proxy(scope, receive, send, replica, headers, prepared,
                                        request)  # fmt: skip
            except RetryableBeforeFirstByte as exc:
                if attempt == 1 or len(route.replicas) <= len(tried):
                    raise
                last = exc
                log.info("Retrying %s on another replica: %s", name, exc.error.message)
            finally:
                await release()
        raise errors.model_not_ready(name)

    async def _can_take(self, route: Route) -> bool:
        """Whether ``route`` can take a request now: a replica that takes traffic (Ready,
        not draining, not in maintenance) and room in its fair queue (router.queue). An
        alias moves on to its next target if not."""
        if not await self.table.ready_replicas(route):
            return False
        if not settings.MIRBAD.queue_enabled:
            return True
        bound = route.queue_max if route.queue_max is not None else settings.MIRBAD.queue_max
        return not await self.queue().full(route.served_name, bound)

    async def _fell_back(
        self, name: str, passed: list[Route], failed: list[tuple[str, str]], used: Route
    ) -> None:
        """Log and count a request to the route ``name`` that a later target took."""
        why = dict(failed)
        reasons = []
        for route in passed:
            reason = why.get(route.served_name) or await self._why_not(route)
            reasons.append(f"'{route.served_name}' ({reason})")
        log.info("Route %s: skipped %s; served by '%s'", name, ", ".join(reasons),
                 used.served_name)  # fmt: skip
        metrics.count_fallback(name, used.served_name)

    async def _why_not(self, route: Route) -> str:
        """Why ``route`` could not take a request, for the fallback's log line."""
        try:
            await self.table.pick(route)
        except V1Error as exc:
            return exc.message
        return "no free place for the request"

    async def _load_on_demand(
        self, route: Route, scope: Scope, send: Send, request: Request
    ) -> None:
        """Start ``route``'s stopped model and wait until it is Ready (router.ondemand).

        The wait counts as queued (``queue_wait``). A stream waiting past a second gets
        its 200 text/event-stream headers and an SSE comment line every 5 s, so that
        proxies do not cut it; the answer then continues that stream (the proxy)."""

        async def keepalive() -> None:
            if not request.sse_started:
                request.sse_started = True
                request.status = 200
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            line = f": loading {route.served_name}\n\n".encode()
            await send({"type": "http.response.body", "body": line, "more_body": True})

        client = scope.get("client")
        actor = f"key {request.key_prefix}… from {client[0] if client else '?'}"
        waited = await ondemand.loader_for(self.table).wait(
            route, actor=actor, tick=keepalive if request.stream else None
        )
        request.queue_wait = (request.queue_wait or 0.0) + waited

    async def _slot(
        self, route: Route, key: KeyInfo, tried: set[str], receive: Receive, request: Request
    ) -> tuple[Replica, Callable[[], Awaitable[None]]]:
        """A replica of ``route`` with a free slot, and the call that frees the slot
        (awaited exactly once, when the answer ended): at once when a slot is free, else
        after a wait in the model's fair queue (router.queue).

        Not a context manager: V1Error is a frozen dataclass, and contextlib's exit
        would fail assigning its traceback."""
        ready = [r for r in await self.table.ready_replicas(route) if r.instance_id not in tried]
        if not ready or not settings.MIRBAD.queue_enabled:
            return await self.table.pick(route, exclude=tried), _nothing  # says why none

        def capacities(replicas: list[Replica]) -> list[tuple[str, int]]:
            return queue_mod.shuffled([(r.instance_id, route.capacity) for r in replicas])

        async def capacities_now() -> list[tuple[str, int]]:
            fresh = await self.table.ready_replicas(route)
            return capacities([r for r in fresh if r.instance_id not in tried])

        timeouts = [t for t in (key.queue_timeout, route.queue_timeout) if t is not None]
        entry = queue_mod.Entry(
            name=route.served_name,
            capacities=capacities(ready),
            priority=key.priority,
            key_id=key.id,
            bound=route.queue_max if route.queue_max is not None else settings.MIRBAD.queue_max,
            timeout=min(timeouts) if timeouts else settings.MIRBAD.queue_timeout,
        )
        queue = self.queue()
        try:
            grant = await queue.acquire(entry, receive=receive, capacities_now=capacities_now)
        finally:
            if request.queue_wait is None:
                request.queue_wait = 0.0
        if grant is None:  # Redis away: fail open, uncounted (router.queue)
            return await self.table.pick(route, exclude=tried), _nothing
        # A load on demand before (router.ondemand) counts as queued too.
        request.queue_wait = (request.queue_wait or 0.0) + grant.waited
        metrics.observe_queue_wait(route.served_name, request.queue_wait)
        replica = next((r for r in route.replicas if r.instance_id == grant.instance_id), None)
        if replica is None:  # the placement went away while the request waited
            await queue.release_now(grant, entry.capacities)
            raise errors.model_not_ready(route.served_name)
        return replica, lambda: queue.release_now(grant, entry.capacities)


async def _nothing() -> None:
    pass


async def send_sse_error(send: Send, body: bytes) -> None:
    """End a stream whose headers are out (a load on demand's keep-alive sent them) with
    one ``data: {"error": ...}`` event: an engine's error body as it is when it is such
    an object, else wrapped."""
    try:
        parsed = json.loads(body)
    except JSON_ERRORS:
        parsed = None
    if not (isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)):
        text = body.decode("utf-8", "replace")[:4000]
        parsed = {"error": {"message": text, "type": "server_error", "code": "engine_error"}}
    event = b"data: " + json.dumps(parsed).encode() + b"\n\n"
    with contextlib.suppress(Exception):
        await send({"type": "http.response.body", "body": event, "more_body": False})
