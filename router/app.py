"""The /v1 router: a lean ASGI app ahead of Django (DESIGN.md section 8).

Per request: authenticate the key (cached), read the body up to 64 MiB to find
``model``, resolve the served name to a ready replica (registry + status
cache, never an agent call), and stream the engine's answer back through the
agent's proxy chunk by chunk. aiohttp's client with one long-lived session
carries the data path; each node's TLS context pins that node's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from asgiref.sync import sync_to_async

from nodes.services import node_ssl_context
from router import errors
from router.errors import V1Error
from router.routing import Replica, RoutingTable

log = logging.getLogger("mirbad.router")

MAX_BODY = 64 * 1024 * 1024
ENDPOINT_SCOPES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/responses": "chat",
}
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"content-length",
    b"host",
    b"authorization",
    b"date",  # the ASGI server sets its own
    b"server",
}
# Agent errors are marked by this header; engine errors pass through untouched.
AGENT_ERROR_HEADER = "x-mirbad-agent-error"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class RouterApp:
    def __init__(self) -> None:
        self.table = RoutingTable()
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,
            )
        return self._session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        started = time.perf_counter()
        try:
            await self._handle(scope, receive, send, started)
        except V1Error as exc:
            await self._send_error(send, exc, started)
        except _ClientGone:
            pass

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _send_error(self, send: Send, exc: V1Error, started: float) -> None:
        body = exc.body()
        headers = [*exc.headers(), (b"content-length", str(len(body)).encode())]
        headers.append((b"x-mirbad-overhead-ms", _ms(started)))
        with contextlib.suppress(Exception):
            await send({"type": "http.response.start", "status": exc.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    async def _handle(self, scope: Scope, receive: Receive, send: Send, started: float) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        key = await self._authenticate(headers)
        if path == "/v1/models" and method == "GET":
            await self._list_models(send, key, started)
            return
        scope_needed = ENDPOINT_SCOPES.get(path)
        if scope_needed is None:
            raise V1Error(404, "not_found", f"Unknown endpoint {method} {path}.")
        if method != "POST":
            raise V1Error(405, "method_not_allowed", f"{path} accepts POST only.")
        if scope_needed not in key.scopes:
            raise V1Error(
                403, "scope_not_allowed", f"This API key does not have the '{scope_needed}' scope."
            )
        try:
            body = await _read_body(receive, headers)
        except _TooLarge:
            raise errors.request_too_large(MAX_BODY) from None
        name = _model_name(body)
        if not key.allows_model(name):
            raise V1Error(403, "model_not_allowed", f"This API key may not use the model '{name}'.")
        route = await self.table.route(name)
        if route is None:
            raise errors.model_not_found(name)
        tried: set[str] = set()
        for attempt in range(2):
            replica = await self.table.pick(route, exclude=tried)
            tried.add(replica.instance_id)
            try:
                await self._proxy(scope, receive, send, replica, headers, body, started, name)
                return
            except _RetryableBeforeFirstByte as exc:
                if attempt == 1 or len(route.replicas) <= len(tried):
                    raise exc.error from None
                log.info("Retrying %s on another replica: %s", name, exc.error.message)
        raise errors.model_not_ready(name)

    async def _authenticate(self, headers: dict[bytes, bytes]) -> Any:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if not auth.lower().startswith("bearer "):
            raise errors.invalid_key()
        key = await self.table.key(auth[7:].strip())
        if key is None:
            raise errors.invalid_key()
        return key

    async def _list_models(self, send: Send, key: Any, started: float) -> None:
        names = [n for n in await self.table.ready_models() if key.allows_model(n)]
        body = json.dumps(
            {
                "object": "list",
                "data": [
                    {"id": n, "object": "model", "created": 0, "owned_by": "mirbadllm"}
                    for n in names
                ],
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-mirbad-overhead-ms", _ms(started)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _proxy(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        replica: Replica,
        headers: dict[bytes, bytes],
        body: bytes,
        started: float,
        name: str,
    ) -> None:
        node = replica.node
        context = await sync_to_async(node_ssl_context, thread_sensitive=False)(node)
        url = f"{node.address.rstrip('/')}/agent/v1/proxy/{replica.instance_id}{scope['path']}"
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        forward = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in headers.items()
            if k not in HOP_BY_HOP
        }
        table = self.table
        table.in_flight[replica.instance_id] = table.in_flight.get(replica.instance_id, 0) + 1
        overhead = time.perf_counter() - started
        try:
            try:
                response = await self.session().request(
                    "POST", url, data=body, headers=forward, ssl=context
                )
            except (aiohttp.ClientConnectionError, TimeoutError, OSError) as exc:
                log.warning("Node %s unreachable for %s: %r", node.node_id, name, exc)
                raise _RetryableBeforeFirstByte(
                    errors.node_unreachable(name, node.node_id)
                ) from exc
            async with response:
                agent_error = response.headers.get(AGENT_ERROR_HEADER)
                if agent_error:
                    await self._agent_error(response, agent_error, name, node.node_id)
                header_start = time.perf_counter()
                out_headers = [
                    (k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in response.headers.items()
                    if k.lower().encode("latin-1") not in HOP_BY_HOP
                    and k.lower() != AGENT_ERROR_HEADER
                ]
                overhead += time.perf_counter() - header_start
                out_headers.append((b"x-mirbad-overhead-ms", f"{overhead * 1000:.2f}".encode()))
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": out_headers,
                    }
                )
                await _stream(response, receive, send)
        finally:
            table.in_flight[replica.instance_id] -= 1

    async def _agent_error(
        self, response: aiohttp.ClientResponse, code: str, name: str, node_id: str
    ) -> None:
        try:
            message = (await response.json())["error"]["message"]
        except Exception:
            message = code
        if code == "model_not_running":
            raise _RetryableBeforeFirstByte(errors.model_not_ready(name))
        if code == "server_busy":
            raise V1Error(503, "server_busy", f"Node '{node_id}' is at its limit.", retry_after=5)
        if code == "client_not_master":
            raise errors.upstream_unavailable(f"Node '{node_id}' refused the master: {message}")
        raise errors.upstream_unavailable(message)


class _RetryableBeforeFirstByte(Exception):
    def __init__(self, error: V1Error) -> None:
        super().__init__(error.message)
        self.error = error


async def _read_body(receive: Receive, headers: dict[bytes, bytes]) -> bytes:
    declared = headers.get(b"content-length")
    if declared is not None:
        try:
            if int(declared) > MAX_BODY:
                raise _TooLarge
        except ValueError:
            raise V1Error(400, "invalid_request", "Content-Length is not a number.") from None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _model_name(body: bytes) -> str:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise V1Error(400, "invalid_request", "The body must be a JSON object.") from None
    if not isinstance(data, dict):
        raise V1Error(400, "invalid_request", "The body must be a JSON object.")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise V1Error(
            400, "invalid_request", "'model' is required: name a served model.", param="model"
        )
    return model


async def _stream(response: aiohttp.ClientResponse, receive: Receive, send: Send) -> None:
    """Forward each chunk as it arrives; a client that goes away cancels the upstream."""

    async def pump() -> None:
        async for chunk in response.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    pump_task = asyncio.create_task(pump())
    watch_task = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if pump_task in done:
            exc = pump_task.exception()
            if exc is not None and not isinstance(exc, aiohttp.ClientPayloadError):
                raise exc
            if isinstance(exc, aiohttp.ClientPayloadError):
                # The upstream aborted mid-stream: end ours the same way.
                raise _ClientGone from exc
        else:
            response.close()  # the client left: drop the upstream request now
            raise _ClientGone
    finally:
        for task in (pump_task, watch_task):
            task.cancel()
        await asyncio.gather(pump_task, watch_task, return_exceptions=True)


def _ms(started: float) -> bytes:
    return f"{(time.perf_counter() - started) * 1000:.2f}".encode()
