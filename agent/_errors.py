"""The agent's exceptions.

One tree, so callers can catch as broadly or narrowly as they need::

    AgentError                      anything the agent raises on purpose
    +-- ConfigError                 a config field is wrong (names the field)
    +-- IdentityError               agent.key / agent.crt / ca.crt missing or inconsistent
    +-- EnrollmentError             enrolling with the master failed
    |   +-- UntrustedEnrollEndpoint the listener or CA did not match the pinned CA hash
    |   +-- TokenRefused            401 token_invalid / token_used / token_expired
    |   +-- EnrollmentRefused       any other refusal (409 node_enrolled, 400 ...)
    +-- InstallError                install-llama-server could not finish
    +-- ApiError                    an error answered on the HTTP API (code + status)
        +-- InvalidRequest          400 invalid_request
        +-- ClientNotMaster         403 client_not_master
        +-- NotFound                404 not_found
        +-- MethodNotAllowed        405 method_not_allowed
        +-- Conflict                409 conflict
        |   +-- DownloadRunning     409 download_running (a download for that folder is going)
        |   +-- FolderExists        409 folder_exists (the folder is already there)
        |   +-- InsufficientDisk    409 insufficient_disk (the selection does not fit)
        |   +-- NotFetched          409 not_fetched (no manifest: the operator's folder)
        |   +-- FolderInUse         409 folder_in_use (an instance runs from the folder)
        +-- SpecRejected            422 spec_rejected
        +-- ExecutableUnverified    422 executable_unverified
        +-- NothingToDownload       422 nothing_to_download
        +-- NotSupported            501 not_supported
        +-- UpstreamUnavailable     502 upstream_unavailable
        +-- ModelNotRunning         503 model_not_running
        +-- ServerBusy              503 server_busy
        +-- StateUnavailable        503 state_unavailable

    WireError                       a request of the proxy hops' HTTP client failed (agent._wire)
    +-- ConnectFailed               connect or TLS handshake failed: nothing was sent
    +-- ReadTimeout                 no byte for the idle timeout (also a TimeoutError)
    +-- Disconnected                closed or broken before the answer was complete
    +-- BadResponse                 the server's bytes are not HTTP/1.1

WireError is not an AgentError: it is a transport failure the caller turns into its own
answer (the agent's proxy into 502 upstream_unavailable, the router into node_unreachable).

Each ApiError subclass carries the code and HTTP status from the contract table in
docs/agent-api.md, so the server turns any of them into the same JSON error shape.
"""

from __future__ import annotations

from typing import Any, ClassVar

# Marks an answer as the agent's own error (its code as the value); an engine's
# errors pass through the proxy without it, so the master's router tells them apart.
ERROR_HEADER = "x-mirbad-agent-error"


class AgentError(Exception):
    """Base of every error the agent raises deliberately."""


class ConfigError(AgentError):
    """A config value is missing or wrong.

    The message always names the field (and the environment variable when the value
    came from one), because the operator fixing it only has the message to go on.
    """

    def __init__(self, message: str, *, field: str | None = None, file: str | None = None) -> None:
        self.field = field
        self.file = file
        self.message = message
        parts = [p for p in (file, field) if p]
        super().__init__(": ".join([*parts, message]))


class IdentityError(AgentError):
    """The agent's TLS identity is missing or does not fit its config."""


class EnrollmentError(AgentError):
    """Enrollment failed; ``code`` is the master's error code when it answered one."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        self.code = code
        super().__init__(message)


class UntrustedEnrollEndpoint(EnrollmentError):
    """The enroll listener or its CA does not match the CA hash the agent was given."""


class TokenRefused(EnrollmentError):
    """The master refused the join token (invalid, used or expired); retrying cannot help."""


class EnrollmentRefused(EnrollmentError):
    """The master refused the enrollment for another reason (e.g. the node holds a pin)."""


class InstallError(AgentError):
    """install-llama-server could not build or lay out the executable."""


class ApiError(AgentError):
    """An error answered on the agent API as ``{"error": {"code", "message"}}``."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        self.message = message
        self.details = details
        super().__init__(message)

    def to_json(self) -> dict[str, Any]:
        """The body the API answers for this error."""
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            error["details"] = self.details
        return {"error": error}


class InvalidRequest(ApiError):
    code = "invalid_request"
    status = 400


class ClientNotMaster(ApiError):
    code = "client_not_master"
    status = 403


class NotFound(ApiError):
    code = "not_found"
    status = 404


class MethodNotAllowed(ApiError):
    code = "method_not_allowed"
    status = 405


class Conflict(ApiError):
    code = "conflict"
    status = 409


class SpecRejected(ApiError):
    code = "spec_rejected"
    status = 422


class ExecutableUnverified(ApiError):
    code = "executable_unverified"
    status = 422


class UpstreamUnavailable(ApiError):
    code = "upstream_unavailable"
    status = 502


class ModelNotRunning(ApiError):
    code = "model_not_running"
    status = 503


class ServerBusy(ApiError):
    code = "server_busy"
    status = 503


class StateUnavailable(ApiError):
    code = "state_unavailable"
    status = 503


class DownloadRunning(Conflict):
    code = "download_running"


class FolderExists(Conflict):
    code = "folder_exists"


class InsufficientDisk(Conflict):
    code = "insufficient_disk"


class NotFetched(Conflict):
    code = "not_fetched"


class FolderInUse(Conflict):
    code = "folder_in_use"


class NothingToDownload(ApiError):
    code = "nothing_to_download"
    status = 422


class NotSupported(ApiError):
    code = "not_supported"
    status = 501


class WireError(Exception):
    """A request of the proxy hops' HTTP client (agent._wire) failed."""


class ConnectFailed(WireError):
    """The connection (or its TLS handshake) failed: the server received nothing."""


class ReadTimeout(WireError, TimeoutError):
    """The server sent nothing for the idle timeout."""


class Disconnected(WireError):
    """The server closed or broke the connection before the answer was complete."""


class BadResponse(WireError):
    """The server's bytes are not HTTP/1.1."""
