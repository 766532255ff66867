"""OpenAI-shaped errors of /v1, with the codes and Retry-After of docs/operator-guide.md."""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class V1Error(Exception):
    status: int
    code: str
    message: str
    retry_after: int | None = None
    param: str | None = None

    def body(self) -> bytes:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        elif self.status == 403:
            kind = "permission_error"
        elif self.status == 503:
            kind = "service_unavailable"
        return json.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": kind,
                    "param": self.param,
                    "code": self.code,
                }
            }
        ).encode()

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            out.append((b"retry-after", str(self.retry_after).encode()))
        if self.status == 401:
            out.append((b"www-authenticate", b'Bearer realm="mirbad"'))
        return out


def invalid_key() -> V1Error:
    return V1Error(
        401,
        "invalid_api_key",
        "The API key is missing, unknown, revoked or expired. Send 'Authorization: Bearer <key>'.",
    )


def model_not_found(name: str) -> V1Error:
    return V1Error(404, "model_not_found", f"The model '{name}' does not exist.", param="model")


def model_not_ready(name: str) -> V1Error:
    return V1Error(503, "model_not_ready", f"The model '{name}' is not ready.", retry_after=30)


def node_offline(name: str, node: str) -> V1Error:
    return V1Error(
        503,
        "node_offline",
        f"The node '{node}' serving model '{name}' is offline.",
        retry_after=30,
    )


def maintenance(name: str, node: str, seconds_left: float, reason: str) -> V1Error:
    why = f" ({reason})" if reason else ""
    return V1Error(
        503,
        "maintenance",
        f"The node '{node}' serving model '{name}' is held for maintenance{why}.",
        retry_after=max(1, math.ceil(seconds_left)),
    )


def node_incompatible(name: str, node: str) -> V1Error:
    return V1Error(
        503,
        "node_incompatible",
        f"The node '{node}' serving model '{name}' speaks no common protocol version.",
        retry_after=300,
    )


def node_unreachable(name: str, node: str) -> V1Error:
    return V1Error(
        503,
        "node_unreachable",
        f"The node '{node}' serving model '{name}' cannot be reached right now.",
        retry_after=10,
    )


def model_unplaced(name: str) -> V1Error:
    return V1Error(503, "model_unplaced", f"The model '{name}' is not placed on any node.")


def request_too_large(limit: int) -> V1Error:
    return V1Error(
        413,
        "request_too_large",
        f"The request body is larger than {limit // (1024 * 1024)} MiB.",
    )


def upstream_unavailable(message: str) -> V1Error:
    return V1Error(502, "upstream_unavailable", message)


def upstream_timeout(name: str, node: str, seconds: float) -> V1Error:
    """504 when an agent sent nothing for the router's read timeout before the answer began."""
    return V1Error(
        504,
        "upstream_timeout",
        f"The node '{node}' serving model '{name}' sent nothing for {seconds:g} s "
        "(MIRBAD_UPSTREAM_READ_TIMEOUT); it may be unreachable or stalled.",
    )


def rate_limited(message: str, retry_after: int) -> V1Error:
    """429 for a key over one of its limits; Retry-After is at least 1 s."""
    return V1Error(429, "rate_limited", message, retry_after=max(1, retry_after))


def too_many_failed_keys(retry_after: int) -> V1Error:
    """429 for a source address past its failed key lookups (core.throttle)."""
    return V1Error(
        429,
        "too_many_failed_keys",
        "Too many requests with unknown, revoked or expired API keys from this address; "
        "no key is checked until Retry-After has passed.",
        retry_after=max(1, retry_after),
    )


def queue_full(name: str, depth: int, retry_after: int) -> V1Error:
    """The served name's fair queue holds its most (router.queue)."""
    return V1Error(
        429,
        "queue_full",
        f"The queue for '{name}' is full ({depth} waiting); retry after {retry_after} s.",
        retry_after=retry_after,
    )


def queue_timeout(name: str, waited: float, retry_after: int) -> V1Error:
    """A request waited its longest in the fair queue (router.queue)."""
    return V1Error(
        429,
        "queue_timeout",
        f"Waited {waited:.0f} s in the queue for '{name}' without a free slot; "
        f"retry after {retry_after} s, or raise the key's or the model's queue timeout.",
        retry_after=retry_after,
    )


def model_failed(name: str, why: str, retry_after: int) -> V1Error:
    """A model loaded on demand failed (or its start was refused); not retried for a
    minute (router.ondemand). ``why`` carries the engine's last log lines."""
    return V1Error(
        503,
        "model_failed",
        f"The model '{name}' could not be loaded: {why}",
        retry_after=max(1, retry_after),
    )


def model_load_timeout(name: str, seconds: float) -> V1Error:
    """A model loaded on demand was not Ready within its loadTimeoutSeconds."""
    return V1Error(
        503,
        "model_load_timeout",
        f"The model '{name}' was started on demand but was not Ready within its "
        f"loadTimeoutSeconds ({seconds:g} s); it may still become Ready: retry later, "
        "or raise loadTimeoutSeconds.",
        retry_after=30,
    )


def budget_exceeded(
    kind: str, used: int, limit: int, zone: str, resets_at: datetime.datetime, retry_after: int
) -> V1Error:
    """A key used up its token budget of the day or month (router.budgets)."""
    name = "daily" if kind == "day" else "monthly"
    return V1Error(
        429,
        "budget_exceeded",
        f"This API key used {used} of its {name} budget of {limit} tokens ({zone}); it "
        f"resets at {resets_at:%Y-%m-%dT%H:%M:%SZ}, retry after {retry_after} s.",
        retry_after=max(1, retry_after),
    )
