"""Prometheus metrics of the /v1 router, rendered on ``/metrics`` (issue 5).

One dedicated ``CollectorRegistry`` per ``Metrics`` (never prometheus_client's global
one, so Django, tests and libraries cannot collide with it). The families:

=========================================  ==========  ===============================
``mirbad_v1_requests_total``               counter     model, key_prefix, code
``mirbad_v1_errors_total``                 counter     model, key_prefix, code
``mirbad_v1_request_seconds``              histogram   model
``mirbad_v1_ttfb_seconds``                 histogram   model
``mirbad_v1_router_overhead_seconds``      histogram   (none)
``mirbad_v1_tokens_total``                 counter     model, key_prefix, kind
``mirbad_v1_in_flight``                    gauge       model
``mirbad_v1_route_fallbacks_total``        counter     route, served
``mirbad_v1_queue_wait_seconds``           histogram   model
=========================================  ==========  ===============================

``/metrics`` also carries the fleet's families (``mirbad_node_*``, ``mirbad_model_*``,
``mirbad_queue_depth``): ``router.fleet_metrics`` reads them from the registry, the
node statuses and the telemetry history at each scrape (docs/decisions.md D64).

Labels:

* ``code`` of ``requests_total`` is the HTTP status sent to the client ("200",
  "400", "503"; 499, nginx's convention, for a client that left before the end). ``code`` of ``errors_total`` is the machine error code when there
  is one (the router's own V1Error codes such as ``model_not_ready``, or what the
  caller names an error inside a 200 stream, e.g. ``stream_error``), else the HTTP
  status. An error is any status >= 400 or any request given an ``error_code``.
  Both are bounded sets.
* ``model`` is the route's served name, which exists in the registry, or
  ``"unknown"`` when the request named no existing model: the caller must never pass
  the client's free-form ``model`` string. ``key_prefix`` is the API key's stored
  prefix, or ``"none"`` before a key was authenticated. As a last guard against a
  caller bug, each label keeps at most ``max_label_values`` distinct values; later
  new ones are counted under ``"other"``.
* ``kind`` of ``tokens_total`` is ``prompt`` or ``completion``.

Buckets: request time from 5 ms to 10 min (a long generation), time to first byte
from 1 ms to 2 min, router overhead from 0.1 ms to 100 ms with a 1.3 ms bucket, the
added-latency target, so "within target" is one bucket read.

Each uvicorn process has its own registry; the router runs as one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

__all__ = [
    "METRICS",
    "Metrics",
    "add_tokens",
    "in_flight",
    "observe_request",
    "render",
]

REQUEST_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
TTFB_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# A free slot is 0; a wait is the engine's slot time or more, up to the 60 s default.
QUEUE_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
OVERHEAD_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0013,
    0.002,
    0.003,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)

OTHER = "other"
UNKNOWN_MODEL = "unknown"
NO_KEY = "none"

_M = TypeVar("_M", bound=MetricWrapperBase)


class Metrics:
    """The router's metric families in their own registry, with a cheap per-request API."""

    def __init__(self, max_label_values: int = 1000) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._max = max_label_values
        self._models: set[str] = set()
        self._keys: set[str] = set()
        r = self.registry
        self.requests = Counter(
            "mirbad_v1_requests",
            "Requests answered by /v1, by HTTP status sent.",
            ("model", "key_prefix", "code"),
            registry=r,
        )
        self.errors = Counter(
            "mirbad_v1_errors",
            "Requests that ended in an error, by error code (else HTTP status).",
            ("model", "key_prefix", "code"),
            registry=r,
        )
        self.request_seconds = Histogram(
            "mirbad_v1_request_seconds",
            "Time from a request's arrival to its last byte sent.",
            ("model",),
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.ttfb_seconds = Histogram(
            "mirbad_v1_ttfb_seconds",
            "Time from a request's arrival to the first body byte sent to the client.",
            ("model",),
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        self.overhead_seconds = Histogram(
            "mirbad_v1_router_overhead_seconds",
            "Time the router itself added to a request (everything but the upstream).",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "mirbad_v1_tokens",
            "Tokens reported in the engines' usage, by kind (prompt|completion).",
            ("model", "key_prefix", "kind"),
            registry=r,
        )
        self.in_flight_gauge = Gauge(
            "mirbad_v1_in_flight",
            "Requests being proxied right now.",
            ("model",),
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "mirbad_v1_queue_wait_seconds",
            "Time a request waited in its model's fair queue for a free slot (0: none).",
            ("model",),
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "mirbad_v1_route_fallbacks",
            "Requests to a route answered by a later target than its first (a fallback).",
            ("route", "served"),
            registry=r,
        )
        # labels() takes a lock and builds a key each time; a plain dict of the
        # children keeps the per-request cost to lookups. Bounded by the label guard.
        self._children: dict[tuple[object, ...], MetricWrapperBase] = {}

    def _model(self, model: str) -> str:
        return _bounded(model or UNKNOWN_MODEL, self._models, self._max)

    def _key(self, key_prefix: str) -> str:
        return _bounded(key_prefix or NO_KEY, self._keys, self._max)

    def _child(self, family: _M, *labels: str) -> _M:
        cache_key = (id(family), *labels)
        child = self._children.get(cache_key)
        if child is None:
            child = family.labels(*labels)
            self._children[cache_key] = child
        return child  # type: ignore[return-value]  # labels() returns the family's type

    def observe_request(
        self,
        model: str,
        key_prefix: str,
        status: int,
        seconds: float,
        ttfb: float | None = None,
        overhead: float | None = None,
        error_code: str | None = None,
    ) -> None:
        """Count one finished request and observe its times (None: not measured)."""
        model = self._model(model)
        key_prefix = self._key(key_prefix)
        code = str(status)
        self._child(self.requests, model, key_prefix, code).inc()
        if error_code is not None or status >= 400:
            self._child(self.errors, model, key_prefix, error_code or code).inc()
        self._child(self.request_seconds, model).observe(seconds)
        if ttfb is not None:
            self._child(self.ttfb_seconds, model).observe(ttfb)
        if overhead is not None:
            self.overhead_seconds.observe(overhead)

    def add_tokens(self, model: str, key_prefix: str, prompt: int, completion: int) -> None:
        """Add a response's usage; a zero count (embeddings' completion) adds nothing."""
        model = self._model(model)
        key_prefix = self._key(key_prefix)
        if prompt > 0:
            self._child(self.tokens, model, key_prefix, "prompt").inc(prompt)
        if completion > 0:
            self._child(self.tokens, model, key_prefix, "completion").inc(completion)

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        self._child(self.queue_wait_seconds, self._model(model)).observe(seconds)

    def count_fallback(self, route: str, served: str) -> None:
        """One request to ``route`` answered by ``served``, not its first target. Both
        names exist in the registry (never the client's free text), bounded as models."""
        self._child(self.fallbacks, self._model(route), self._model(served)).inc()

    def inc_in_flight(self, model: str) -> None:
        self._child(self.in_flight_gauge, self._model(model)).inc()

    def dec_in_flight(self, model: str) -> None:
        self._child(self.in_flight_gauge, self._model(model)).dec()

    @contextlib.contextmanager
    def in_flight(self, model: str) -> Iterator[None]:
        """Count the body of the ``with`` as one request in flight for ``model``."""
        gauge = self._child(self.in_flight_gauge, self._model(model))
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every family, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _bounded(value: str, seen: set[str], limit: int) -> str:
    if value in seen:
        return value
    if len(seen) >= limit:
        return OTHER
    seen.add(value)
    return value


# The router's process-wide instance, and its methods as module functions.
METRICS = Metrics()
observe_request = METRICS.observe_request
add_tokens = METRICS.add_tokens
in_flight = METRICS.in_flight
observe_queue_wait = METRICS.observe_queue_wait
inc_in_flight = METRICS.inc_in_flight
count_fallback = METRICS.count_fallback
dec_in_flight = METRICS.dec_in_flight
render = METRICS.render
