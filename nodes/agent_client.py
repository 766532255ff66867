"""The master's client for the agent API (docs/agent-api.md).

Every connection is pinned: the TLS context checks the agent's certificate
inside the handshake (chain, the node's SPIFFE id, the SPKI pin), so no request
byte reaches a machine that is not the node we meant. httpx serves the control
plane; the /v1 data path uses the agent package's wire client in ``router/`` (D29).

Every value put into a request path goes through :func:`path_segment`, percent-encoded
whole: a folder name holding ``?file=``, ``/`` or a NUL stays one segment of the path
the agent parses (and refuses), never a query or another path.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from django.conf import settings

from core.errors import ServiceError
from nodes import fencing
from nodes.models import Node
from nodes.services import master_pki, node_ssl_context
from protocol.names import NameRefused, check_file_name, check_folder_name

# How long the monitor keeps an idle connection to an agent: longer than the telemetry
# interval (5 s), shorter than the agent's own idle limit (75 s).
KEEPALIVE_SECONDS = 30.0


class AgentError(Exception):
    """Base of the agent client's errors."""


class AgentUnreachable(AgentError):
    """The agent could not be reached, or failed the identity check."""


class AgentTimeout(AgentUnreachable):
    """The request was sent but no answer came in time: its outcome is unknown."""


class AgentRefused(AgentError):
    """The agent answered with an error document."""

    def __init__(
        self, *, status: int, code: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}


def check_folder(folder: object, field: str = "folder") -> str:
    """``folder`` if the agent takes it as a model folder name, else a 400 naming ``field``.

    The agent's own rule (``protocol.names.check_folder_name``), so the master's API refuses
    exactly what the agent would, before it picks a node or sends anything.
    """
    try:
        # The agent's message starts with what it is given; the master's say "field: ...".
        return check_folder_name(folder, f"{field}:")
    except NameRefused as exc:
        raise ServiceError(400, "invalid_request", str(exc), details={"field": field}) from None


def check_file(file: object, field: str = "file") -> str:
    """``file`` if the agent takes it as a file of a model folder, else a 400 naming ``field``.

    The agent's own rule (``protocol.names.check_file_name``): one plain name, the same on
    every platform (no separator, drive, stream or Windows device name).
    """
    try:
        return check_file_name(file, f"{field}:")
    except NameRefused as exc:
        raise ServiceError(400, "invalid_request", str(exc), details={"field": field}) from None


def path_segment(value: str) -> str:
    """``value`` as one segment of an agent URL path, every reserved character encoded."""
    if value in ("", ".", ".."):
        # Encoding leaves these alone, and a client or server may resolve them away.
        raise AgentRefused(
            status=400, code="invalid_request", message=f"{value!r} is not a usable name"
        )
    return quote(value, safe="")


def agent_url(node: Node) -> str:
    return node.address.rstrip("/") + "/agent/v1"


def _describe(exc: Exception) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            detail = getattr(cause, "verify_message", None) or str(cause)
            return f"the agent's certificate was refused: {detail}"
        cause = cause.__cause__ or cause.__context__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def check_answer(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        details: dict[str, Any] = {}
        try:
            error = response.json()["error"]
            code, message = str(error["code"]), str(error["message"])
            if isinstance(error.get("details"), dict):
                details = error["details"]
        except (ValueError, KeyError, TypeError):
            code, message = "unexpected_answer", response.text[:200]
        raise AgentRefused(status=response.status_code, code=code, message=message, details=details)
    if response.status_code == 204 or not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise AgentRefused(
            status=response.status_code, code="unexpected_answer", message="not JSON"
        ) from None


def _exchange(
    node: Node, method: str, path: str, send: Callable[[], httpx.Response]
) -> httpx.Response:
    """``send()``, its httpx errors as the client's: sent and unanswered is AgentTimeout."""
    try:
        return send()
    except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
        # Sent, maybe acted on: the caller must not assume either outcome.
        raise AgentTimeout(
            f"node {node.node_id}: no answer to {method} {path} in time; the outcome is unknown"
        ) from exc
    except httpx.HTTPError as exc:
        raise AgentUnreachable(f"node {node.node_id}: {_describe(exc)}") from exc


class AgentClient:
    """Blocking client, for services called from views and tasks.

    Every mutation goes through :func:`nodes.operations.send`: recorded in the master's
    operation log before it is sent, sent with its operation id, retried under that id
    when its answer is lost (docs/decisions.md D75).
    """

    def __init__(self, *, node: Node, timeout: float = 15.0) -> None:
        self.node = node
        self.timeout = timeout
        self._client = httpx.Client(
            base_url=agent_url(node),
            verify=node_ssl_context(node),
            timeout=timeout,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, *, responses: list[httpx.Response] | None = None,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """One request; its JSON answer. ``responses`` receives the raw response (the
        operation log keeps its status and whether the agent answered from its log)."""
        response = _exchange(
            self.node, method, path, lambda: self._client.request(method, path, **kwargs)
        )
        if responses is not None:
            responses.append(response)
        return check_answer(response)

    def request_via(
        self, via: httpx.Client, method: str, path: str, *,
        responses: list[httpx.Response] | None = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        """:meth:`_request` over another client of the same node (the rotation's proof
        connection), with the same errors."""
        call = getattr(via, method.lower())  # via.post(...): what the proof always sent
        response = _exchange(self.node, method, path, lambda: call(path, **kwargs))
        if responses is not None:
            responses.append(response)
        return check_answer(response)

    def info(self) -> dict[str, Any]:
        return self._request("GET", "/info")

    def status(self) -> dict[str, Any]:
        return self._request("GET", "/status")

    def fencing_headers(self) -> dict[str, str]:
        """The fencing triple and request time of one mutation (read again for each
        attempt); nodes.operations adds the operation id."""
        try:
            return fencing.request_headers(settings.MIRBAD.data_path)
        except fencing.FencingError as exc:
            raise AgentRefused(status=503, code="monitor_not_started", message=str(exc)) from None

    def _mutate(self, kind: str, method: str, path: str, target: str, **kwargs: Any) -> Any:
        from nodes import operations  # it imports this module's errors

        return operations.send(self, kind=kind, method=method, path=path, target=target, **kwargs)

    def launch(self, spec: dict[str, Any]) -> dict[str, Any]:
        target = str(spec.get("instanceId") or "") if isinstance(spec, dict) else ""
        return self._mutate("launch", "POST", "/instances", target, json=spec)

    def stop(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{path_segment(instance_id)}/stop"
        return self._mutate("stop", "POST", path, instance_id)

    # A certificate rotation (docs/agent-api.md, "Certificate rotation"): each step is a
    # fenced mutation with its own operation id; the rotation id makes it idempotent.

    def rotation_start(self, rotation_id: str) -> dict[str, Any]:
        return self._mutate(
            "rotation_start",
            "POST",
            "/pki/rotations",
            rotation_id,
            json={"rotationId": rotation_id},
        )

    def rotation(self, rotation_id: str) -> dict[str, Any]:
        return self._request("GET", f"/pki/rotations/{path_segment(rotation_id)}")

    def rotation_install(self, rotation_id: str, cert_pem: str) -> dict[str, Any]:
        path = f"/pki/rotations/{path_segment(rotation_id)}/cert"
        return self._mutate(
            "rotation_install", "PUT", path, rotation_id, json={"certPem": cert_pem}
        )

    def rotation_commit(self, rotation_id: str, *, via: httpx.Client) -> dict[str, Any]:
        """The commit, over ``via``: the proof connection that saw the pending certificate."""
        path = f"/pki/rotations/{path_segment(rotation_id)}/commit"
        return self._mutate("rotation_commit", "POST", path, rotation_id, via=via)

    def rotation_abort(self, rotation_id: str) -> dict[str, Any]:
        path = f"/pki/rotations/{path_segment(rotation_id)}/abort"
        return self._mutate("rotation_abort", "POST", path, rotation_id)

    def gguf(self, folder: str, file: str | None) -> dict[str, Any]:
        params = {"file": file} if file else None
        return self._request("GET", f"/folders/{path_segment(folder)}/gguf", params=params)

    def instances(self) -> list[dict[str, Any]]:
        return self._request("GET", "/instances")["instances"]

    def images(self) -> dict[str, Any]:
        """``{"images": [...], "truncated": bool}``: the container images the node's
        Docker engine holds (501 not_supported without DockerEnabled)."""
        return self._request("GET", "/images")

    # Downloads and weights. The token rides in the body of the POST only (the operation
    # log keeps a redacted summary of the answer, never the body sent).

    def start_download(self, body: dict[str, Any]) -> dict[str, Any]:
        target = str(body.get("folder") or "") if isinstance(body, dict) else ""
        return self._mutate("download", "POST", "/downloads", target, json=body)

    def downloads(self) -> list[dict[str, Any]]:
        return self._request("GET", "/downloads")["downloads"]

    def download(self, folder: str) -> dict[str, Any]:
        return self._request("GET", f"/downloads/{path_segment(folder)}")

    def cancel_download(self, folder: str) -> dict[str, Any]:
        path = f"/downloads/{path_segment(folder)}"
        return self._mutate("cancel_download", "DELETE", path, folder)

    def model_folders(self) -> dict[str, Any]:
        return self._request("GET", "/model-folders")

    def reclaim(self, folder: str) -> dict[str, Any]:
        return self._mutate("reclaim", "DELETE", f"/model-folders/{path_segment(folder)}", folder)


# An event stream's event is a few kilobytes (a heartbeat with its telemetry sample);
# an agent that sends a megabyte without an end is refused, not buffered for ever.
EVENT_MAX_BYTES = 2**20


def parse_event(block: bytes) -> tuple[str, dict[str, Any]] | None:
    """One server-sent event (its lines, without the blank line that ends it): its type
    and its data as an object ({} for data that is not a JSON object), or None without
    data. Read from bytes, decoded with orjson: the monitor reads one per node every
    5 s, and httpx's line iterator and ``json`` were a seventh of its CPU at 300 nodes."""
    event = "message"
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip())
        elif line.startswith(b"event:"):
            event = line[6:].strip().decode(errors="replace")
    if not data:
        return None
    try:
        payload = orjson.loads(b"\n".join(data))
    except orjson.JSONDecodeError:
        payload = {}
    return event, payload if isinstance(payload, dict) else {}


class AsyncAgentClient:
    """Async client for the monitor (snapshots, telemetry, the event stream) and the
    console's log panel (logs)."""

    def __init__(self, *, node: Node, timeout: float = 10.0) -> None:
        self.node = node
        self._timeout = timeout
        self._serial: int | None = master_pki().client.serial
        self._client = self._new_client()
        self._retired: list[httpx.AsyncClient] = []

    def _new_client(self) -> httpx.AsyncClient:
        # httpx drops a connection idle for 5 s by default, and the telemetry is pulled
        # every 5 s: each pull paid a new TLS handshake (a quarter of the monitor's CPU
        # at 100 nodes, docs/performance.md "A fleet of a thousand machines"). The
        # agent keeps an idle connection 75 s (protocol/http_limits.py).
        return httpx.AsyncClient(
            base_url=agent_url(self.node),
            verify=node_ssl_context(self.node),
            timeout=self._timeout,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_SECONDS),
        )

    def _current(self) -> httpx.AsyncClient:
        """The client on the master's current certificate (D53): a monitor runs for longer
        than the certificate it started with lives. The one it replaces stays open for
        what it carries (the event stream) until :meth:`aclose`."""
        serial = master_pki().client.serial
        if serial != self._serial:
            self._serial = serial
            self._retired.append(self._client)
            self._client = self._new_client()
        return self._client

    def retarget(self, node: Node) -> None:
        """The node's pins changed (a pin added): the next request uses a client whose
        context accepts the new set; the current one keeps what it carries."""
        self.node = node
        self._serial = None  # forces the swap in _current()

    async def aclose(self) -> None:
        for client in (*self._retired, self._client):
            await client.aclose()
        self._retired.clear()

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._current().request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise AgentUnreachable(f"node {self.node.node_id}: {_describe(exc)}") from exc
        return check_answer(response)

    async def info(self) -> dict[str, Any]:
        return await self._request("GET", "/info")

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "/status")

    async def telemetry(self) -> dict[str, Any]:
        return await self._request("GET", "/telemetry")

    async def operation(self, operation_id: str) -> dict[str, Any]:
        """The agent's record of one operation (404 operation_unknown: it has none)."""
        return await self._request("GET", f"/operations/{path_segment(operation_id)}")

    # The logs (docs/agent-api.md, "Logs"; docs/decisions.md D62), for the console.

    async def logs(self) -> list[dict[str, Any]]:
        """The logs the node offers: ``agent`` and one per engine instance."""
        return (await self._request("GET", "/logs"))["logs"]

    async def log_lines(
        self, name: str, *, after: int | None = None, limit: int = 200, wait: int = 0
    ) -> dict[str, Any]:
        """``{"name", "lines", "next"}``: the last ``limit`` lines, or those after
        ``after``, long-polled up to ``wait`` seconds (the read timeout allows for it)."""
        params: dict[str, int] = {"limit": limit}
        if after is not None:
            params["after"] = after
            if wait:
                params["wait"] = wait
        timeout = httpx.Timeout(self._timeout, read=self._timeout + wait)
        return await self._request(
            "GET", f"/logs/{path_segment(name)}", params=params, timeout=timeout
        )

    async def events(
        self, *, read_timeout: float, telemetry: bool = False
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield ``(event, data)`` from the SSE stream until it ends or goes silent;
        ``telemetry``: heartbeats carry the telemetry sample (feature ``events.telemetry``)."""
        timeout = httpx.Timeout(10.0, read=read_timeout)
        params = {"telemetry": "1"} if telemetry else None
        try:
            async with self._current().stream(
                "GET", "/events", timeout=timeout, params=params
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    check_answer(response)
                buffer = b""
                async for chunk in response.aiter_bytes():
                    buffer += chunk.replace(b"\r\n", b"\n")
                    *blocks, buffer = buffer.split(b"\n\n")
                    if len(buffer) > EVENT_MAX_BYTES:
                        raise AgentError(
                            f"node {self.node.node_id}: an event over "
                            f"{EVENT_MAX_BYTES // 2**20} MiB on its event stream"
                        )
                    for block in blocks:
                        parsed = parse_event(block)
                        if parsed is not None:
                            yield parsed
        except httpx.HTTPError as exc:
            raise AgentUnreachable(f"node {self.node.node_id}: {_describe(exc)}") from exc
