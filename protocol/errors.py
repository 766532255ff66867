"""What the master reads exactly as the agent writes it: the error header, the error
codes of the agent API (docs/agent-api.md, "Errors"), and the wire client's errors.

The agent's answerable errors (``agent._errors.ApiError`` and its subclasses) take their
codes from :class:`AgentCode`; the router and the master's agent client compare against
the same members, so a renamed code cannot drift on one side only.

The wire client's failures form their own small tree::

    WireError                 a request of protocol.wire failed
    +-- ConnectFailed         connect or TLS handshake failed: nothing was sent
    +-- ReadTimeout           no byte for the idle timeout (also a TimeoutError)
    +-- Disconnected          closed or broken before the answer was complete
    +-- BadResponse           the server's bytes are not HTTP/1.1

A WireError is a transport failure the caller turns into its own answer (the agent's
proxy into 502 upstream_unavailable, the router into node_unreachable).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "ERROR_HEADER",
    "AgentCode",
    "BadResponse",
    "ConnectFailed",
    "Disconnected",
    "ReadTimeout",
    "WireError",
]

# Marks an answer as the agent's own error (its code as the value); an engine's
# errors pass through the proxy without it, so the master's router tells them apart.
ERROR_HEADER = "x-mirbad-agent-error"


class AgentCode(StrEnum):
    """The error codes of the agent API (docs/agent-api.md, "Errors")."""

    INTERNAL_ERROR = "internal_error"
    INVALID_REQUEST = "invalid_request"
    CLIENT_NOT_MASTER = "client_not_master"
    NOT_FOUND = "not_found"
    OPERATION_UNKNOWN = "operation_unknown"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    DOWNLOAD_RUNNING = "download_running"
    FOLDER_EXISTS = "folder_exists"
    INSUFFICIENT_DISK = "insufficient_disk"
    NOT_FETCHED = "not_fetched"
    FOLDER_IN_USE = "folder_in_use"
    STALE_MASTER = "stale_master"
    COMPETING_MASTER = "competing_master"
    CLOCK_SKEW = "clock_skew"
    SPEC_REJECTED = "spec_rejected"
    EXECUTABLE_UNVERIFIED = "executable_unverified"
    NOTHING_TO_DOWNLOAD = "nothing_to_download"
    NOT_SUPPORTED = "not_supported"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    MODEL_NOT_RUNNING = "model_not_running"
    SERVER_BUSY = "server_busy"
    STATE_UNAVAILABLE = "state_unavailable"
    DOCKER_UNAVAILABLE = "docker_unavailable"
    GGUF_INVALID = "gguf_invalid"
    INVALID_STATE = "invalid_state"
    ALREADY_COMMITTED = "already_committed"
    NOT_ON_PENDING_CERTIFICATE = "not_on_pending_certificate"


class WireError(Exception):
    """A request of the proxy hops' HTTP client (protocol.wire) failed."""


class ConnectFailed(WireError):
    """The connection (or its TLS handshake) failed: the server received nothing."""


class ReadTimeout(WireError, TimeoutError):
    """The server sent nothing for the idle timeout."""


class Disconnected(WireError):
    """The server closed or broke the connection before the answer was complete."""


class BadResponse(WireError):
    """The server's bytes are not HTTP/1.1."""
