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
        |   +-- OperationUnknown    404 operation_unknown (no record of that operation id)
        +-- MethodNotAllowed        405 method_not_allowed
        +-- Conflict                409 conflict
        |   +-- DownloadRunning     409 download_running (a download for that folder is going)
        |   +-- FolderExists        409 folder_exists (the folder is already there)
        |   +-- InsufficientDisk    409 insufficient_disk (the selection does not fit)
        |   +-- NotFetched          409 not_fetched (no manifest: the operator's folder)
        |   +-- FolderInUse         409 folder_in_use (an instance runs from the folder)
        |   +-- InvalidState        409 invalid_state (e.g. a second open rotation)
        |   +-- AlreadyCommitted    409 already_committed (abort of a committed rotation)
        |   +-- NotOnPendingCertificate  409 not_on_pending_certificate (commit elsewhere)
        +-- SpecRejected            422 spec_rejected
        +-- ExecutableUnverified    422 executable_unverified
        +-- NothingToDownload       422 nothing_to_download
        +-- NotSupported            501 not_supported
        +-- UpstreamUnavailable     502 upstream_unavailable
        +-- ModelNotRunning         503 model_not_running
        +-- ServerBusy              503 server_busy
        +-- StateUnavailable        503 state_unavailable
        +-- DockerUnavailable       503 docker_unavailable (the container engine does not answer)

    WireError                       a request of the proxy hops' HTTP client failed (protocol.wire)
    +-- ConnectFailed               connect or TLS handshake failed: nothing was sent
    +-- ReadTimeout                 no byte for the idle timeout (also a TimeoutError)
    +-- Disconnected                closed or broken before the answer was complete
    +-- BadResponse                 the server's bytes are not HTTP/1.1

WireError (defined in protocol.errors) is not an AgentError: it is a transport failure the caller turns into its own
answer (the agent's proxy into 502 upstream_unavailable, the router into node_unreachable).

Each ApiError subclass carries the code and HTTP status from the contract table in
docs/agent-api.md, so the server turns any of them into the same JSON error shape.
"""

from __future__ import annotations

from typing import Any, ClassVar

from protocol.errors import (
    ERROR_HEADER,
    AgentCode,
    BadResponse,
    ConnectFailed,
    Disconnected,
    ReadTimeout,
    WireError,
)

# The wire errors and the error header belong to the protocol package (both sides read
# them); they are re-exported here so the agent's tree above stays whole in one place.
__all__ = [
    "ERROR_HEADER",
    "BadResponse",
    "ConnectFailed",
    "Disconnected",
    "ReadTimeout",
    "WireError",
]


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
    code = AgentCode.INVALID_REQUEST
    status = 400


class ClientNotMaster(ApiError):
    code = AgentCode.CLIENT_NOT_MASTER
    status = 403


class NotFound(ApiError):
    code = AgentCode.NOT_FOUND
    status = 404


class OperationUnknown(NotFound):
    """The operation log holds no record of the id: the request never arrived (or the
    record was pruned, docs/agent-api.md "Operation log")."""

    code = AgentCode.OPERATION_UNKNOWN


class MethodNotAllowed(ApiError):
    code = AgentCode.METHOD_NOT_ALLOWED
    status = 405


class Conflict(ApiError):
    code = AgentCode.CONFLICT
    status = 409


class InvalidState(Conflict):
    code = AgentCode.INVALID_STATE


class AlreadyCommitted(Conflict):
    code = AgentCode.ALREADY_COMMITTED


class NotOnPendingCertificate(Conflict):
    code = AgentCode.NOT_ON_PENDING_CERTIFICATE


class SpecRejected(ApiError):
    code = AgentCode.SPEC_REJECTED
    status = 422


class ExecutableUnverified(ApiError):
    code = AgentCode.EXECUTABLE_UNVERIFIED
    status = 422


class UpstreamUnavailable(ApiError):
    code = AgentCode.UPSTREAM_UNAVAILABLE
    status = 502


class ModelNotRunning(ApiError):
    code = AgentCode.MODEL_NOT_RUNNING
    status = 503


class ServerBusy(ApiError):
    code = AgentCode.SERVER_BUSY
    status = 503


class StateUnavailable(ApiError):
    code = AgentCode.STATE_UNAVAILABLE
    status = 503


class DockerUnavailable(ApiError):
    code = AgentCode.DOCKER_UNAVAILABLE
    status = 503


class DownloadRunning(Conflict):
    code = AgentCode.DOWNLOAD_RUNNING


class FolderExists(Conflict):
    code = AgentCode.FOLDER_EXISTS


class InsufficientDisk(Conflict):
    code = AgentCode.INSUFFICIENT_DISK


class NotFetched(Conflict):
    code = AgentCode.NOT_FETCHED


class FolderInUse(Conflict):
    code = AgentCode.FOLDER_IN_USE


class NothingToDownload(ApiError):
    code = AgentCode.NOTHING_TO_DOWNLOAD
    status = 422


class NotSupported(ApiError):
    code = AgentCode.NOT_SUPPORTED
    status = 501
