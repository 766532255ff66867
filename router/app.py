"""The /v1 router: a lean ASGI app ahead of Django (docs/architecture.md).

Per request: authenticate the key (cached), read the body up to 64 MiB to find
``model``, resolve it to its candidates (registry + status cache, never an agent
call), let router.serving choose the candidate and the replica (fair queue, load
on demand, fallbacks), and stream the engine's answer back through the agent's
proxy chunk by chunk (``RouterApp._proxy``). The agent package's lean wire
client (D29) carries the data path with pooled keep-alive connections; each
node's TLS context pins that node's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from django.conf import settings

from core.jsoninput import JSON_ERRORS, NOT_TEXT, is_text, why_not_json
from core.throttle import key_failures, key_prefix
from nodes import status_cache
from nodes.services import master_pki, node_ssl_context
from protocol.errors import (
    ERROR_HEADER,
    AgentCode,
    ConnectFailed,
    Disconnected,
    ReadTimeout,
    WireError,
)
from protocol.wire import WirePool, WireResponse
from router import errors, fleet_metrics, metrics, sse, transform
from router.budgets import Budgets
from router.errors import V1Error
from router.invalidation import Listener
from router.limits import Limiter
from router.queue import FairQueue
from router.recent import recent as recent_requests
from router.relay import ClientGone, Receive, Send, WholeReader, stream, tee
from router.routing import Replica, RoutingTable
from router.serving import Request, RetryableBeforeFirstByte, Serving, send_sse_error
from router.serving import Scope as Scope  # mirbad_site.asgi types its dispatch with it
from router.usage import UsageMeter

log = logging.getLogger("mirbad.router")

MAX_BODY = 64 * 1024 * 1024
SMALL_ANSWER = 1024 * 1024
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
# Agent errors are marked by the agent's ERROR_HEADER; engine errors pass through untouched.
AGENT_ERROR_BYTES = ERROR_HEADER.encode()


class _TooLarge(Exception):
    pass


class RouterApp:
    def __init__(self) -> None:
        self.table = RoutingTable()
        self._pool: WirePool | None = None
        self.listener = Listener(apply=self.apply)
        self._contexts: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._client_serial: int | None = None  # the master certificate of _contexts
        self._pki_check_at = 0.0
        self._targets: dict[tuple[str, str], str] = {}
        self._hosts: dict[str, tuple[str, int]] = {}
        self.meter = UsageMeter()
        self.budgets = Budgets(self.meter)
        self._limiters: dict[int, Limiter] = {}
        self._queues: dict[int, FairQueue] = {}
        self.serving = Serving(self.table, self.queue, self._proxy)

    def apply(self, message: dict[str, Any]) -> None:
        """One invalidation (router.invalidation): the caches, and a node's old contexts."""
        self.table.invalidate(message)
        if message.get("kind") == "node":
            self.retire_contexts(message.get("node"), message.get("pins") or [],
                                 gone=bool(message.get("gone")))  # fmt: skip

    def retire_contexts(self, node_pk: Any, pins: list[str], *, gone: bool) -> int:
        """Drop a node's TLS contexts for pins it no longer has (all when it is gone) and
        retire their pooled connections; returns the connections retired.

        Without this, connections verified under a rekeyed node's old key, or a revoked
        node's, sat in the pool for the keep-alive time (the pool keys them by context,
        so none was handed to a request under the new pins, docs/decisions.md D44).
        """
        current = tuple(pins)
        stale = [k for k in self._contexts if k[0] == node_pk and (gone or k[1] != current)]
        retired = 0
        for cache_key in stale:
            context = self._contexts.pop(cache_key)
            if self._pool is not None:
                retired += self._pool.retire(context)
        if retired:
            log.info("Node #%s changed its pins: %d connection(s) retired", node_pk, retired)
        return retired

    def limiter(self) -> Limiter:
        """One limiter per event loop: redis.asyncio connections belong to their loop."""
        loop_id = id(asyncio.get_running_loop())
        limiter = self._limiters.get(loop_id)
        if limiter is None:
            limiter = Limiter(redis=status_cache.async_client())
            self._limiters = {loop_id: limiter}
        return limiter

    def queue(self) -> FairQueue:
        """One fair queue per event loop, as the limiter (redis.asyncio connections)."""
        loop_id = id(asyncio.get_running_loop())
        queue = self._queues.get(loop_id)
        if queue is None:
            queue = FairQueue(redis=status_cache.async_client())
            self._queues = {loop_id: queue}
        return queue

    async def _follow_master_certificate(self) -> None:
        """Every MIRBAD_PKI_CHECK_SECONDS: when the master's client certificate was
        re-issued (D53), every context goes, and with it the pooled connections made
        under the old certificate once their answers end. Between checks: a clock read."""
        now = time.monotonic()
        if now < self._pki_check_at:
            return
        self._pki_check_at = now + settings.MIRBAD.pki_check_seconds
        serial = (await sync_to_async(master_pki, thread_sensitive=False)()).client.serial
        if serial == self._client_serial:
            return
        if self._client_serial is not None:
            retired = 0
            for context in self._contexts.values():
                if self._pool is not None:
                    retired += self._pool.retire(context)
            self._contexts.clear()
            log.info("The master's client certificate changed: %d connection(s) retired", retired)
        self._client_serial = serial

    async def _ssl_context(self, node: Any) -> Any:
        """The node's pinned TLS context, built once per identity (a thread hop otherwise)."""
        await self._follow_master_certificate()
        cache_key = (node.pk, tuple(node.pins))
        context = self._contexts.get(cache_key)
        if context is None:
            context = await sync_to_async(node_ssl_context, thread_sensitive=False)(node)
            if len(self._contexts) > 10_000:
                self._contexts.clear()
            self._contexts[cache_key] = context
        return context

    def _target(self, instance_id: str, path: str, query: bytes | None) -> str:
        """The agent proxy's request target for (instance, endpoint), built once."""
        if query:
            return f"/agent/v1/proxy/{instance_id}{path}?{query.decode('latin-1')}"
        cache_key = (instance_id, path)
        target = self._targets.get(cache_key)
        if target is None:
            if len(self._targets) > 10_000:
                self._targets.clear()
            target = self._targets[cache_key] = f"/agent/v1/proxy/{instance_id}{path}"
        return target

    def _host(self, address: str) -> tuple[str, int]:
        """(host, port) of a node's agent address such as ``https://10.0.0.5:8443``."""
        hit = self._hosts.get(address)
        if hit is None:
            parts = urlsplit(address)
            if parts.hostname is None:
                raise errors.upstream_unavailable(f"The node's address '{address}' has no host.")
            hit = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
            if len(self._hosts) > 10_000:
                self._hosts.clear()
            self._hosts[address] = hit
        return hit

    def pool(self) -> WirePool:
        """The connection pool to the agents (one per process, made on first use)."""
        if self._pool is None:
            self._pool = WirePool(keepalive_seconds=60.0, connect_timeout=10.0)
        return self._pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        started = time.perf_counter()
        request = Request(started=started)
        try:
            await self._handle(scope, receive, send, request)
        except V1Error as exc:
            request.status, request.error_code = exc.status, exc.code
            if request.sse_started:
                await send_sse_error(send, exc.body())
            else:
                await self._send_error(send, exc, started)
        except ClientGone as exc:
            request.status = 499  # nginx's "client closed request"
            if isinstance(exc.__cause__, ReadTimeout):
                # Not the client: the agent went silent mid-stream and the stream was cut.
                request.status, request.error_code = 504, "upstream_timeout"
        finally:
            if request.key is not None:
                recent_requests.record()
                if request.status >= 400 or request.error_code is not None:
                    self.meter.record_error(request.key, request.metered_as)
            metrics.observe_request(
                request.model,
                request.key_prefix,
                request.status,
                time.perf_counter() - started,
                ttfb=request.ttfb,
                overhead=request.overhead,
                error_code=request.error_code,
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # Everything loaded so far (Django, the apps, their modules) lives as long
                # as the process: out of the collector's sight, a full collection walks
                # only what requests allocate (it took hundreds of ms at c=64, bench p99).
                gc.freeze()
                self.listener.start()
                self.meter.start()
                self.limiter().start()  # renews the leases of long requests' slots
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.listener.stop()
                await self.meter.stop()  # the last few seconds of usage are written too
                await self.budgets.stop()
                await self.limiter().stop()
                for queue in self._queues.values():
                    await queue.stop()  # the last releases are sent
                if self._pool is not None:
                    await self._pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _send_error(self, send: Send, exc: V1Error, started: float) -> None:
        body = exc.body()
        headers = [*exc.headers(), (b"content-length", str(len(body)).encode())]
        headers.append((b"x-mirbad-overhead-ms", _ms(started)))
        with contextlib.suppress(Exception):
            await send({"type": "http.response.start", "status": exc.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    async def _handle(self, scope: Scope, receive: Receive, send: Send, request: Request) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if path == "/metrics" and method == "GET" and b"authorization" not in headers:
            await self._metrics_for_session(send, headers)
            return
        key = await self._authenticate(headers, scope)
        request.key_prefix = key.prefix
        if path == "/metrics" and method == "GET":
            await self._metrics(send, key)
            return
        if path == "/v1/models" and method == "GET":
            await self._list_models(send, key, request.started)
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
        data = _parse(body)
        name = data["model"]
        request.stream = data.get("stream") is True
        if not key.allows_model(name):
            raise V1Error(403, "model_not_allowed", f"This API key may not use the model '{name}'.")
        candidates = await self.table.candidates(name)
        if not candidates:
            raise errors.model_not_found(name)
        request.model = candidates[0].served_name
        await self.budgets.admit(key)  # 429 budget_exceeded, on cached totals (router.budgets)
        ticket = await self.limiter().admit(key)
        usage: tuple[int, int] | None = None
        metrics.inc_in_flight(name)
        try:
            usage = await self.serving.serve(scope, receive, send, key, name, candidates,
                                             headers, body, data, request)  # fmt: skip
        finally:
            metrics.dec_in_flight(name)
            prompt, completion = usage or request.usage or (0, 0)
            await self.limiter().release(ticket, tokens=prompt + completion)
            self.meter.record(
                key, request.model, prompt_tokens=prompt, completion_tokens=completion
            )
            request.key, request.metered_as = key, request.model
            if usage or request.usage:
                metrics.add_tokens(request.model, key.prefix, prompt, completion)

    async def _metrics(self, send: Send, key: Any) -> None:
        """Prometheus text: this web process's router families and the fleet's
        (router.fleet_metrics); scraped with a key that has ``admin``."""
        if "admin" not in key.scopes:
            raise V1Error(403, "scope_not_allowed", "/metrics needs a key with the 'admin' scope.")
        await self._send_metrics(send)

    async def _metrics_for_session(self, send: Send, headers: dict[bytes, bytes]) -> None:
        """/metrics without a key: an operator's console session may read it
        (docs/decisions.md D64)."""
        cookie = headers.get(b"cookie", b"").decode("latin-1")
        verdict = await fleet_metrics.asession_verdict(cookie) if cookie else "none"
        if verdict == "user":
            raise V1Error(
                403, "scope_not_allowed", "/metrics needs an operator's session or an admin key."
            )
        if verdict != "staff":
            raise errors.invalid_key()  # no key and no session: today's 401
        await self._send_metrics(send)

    async def _send_metrics(self, send: Send) -> None:
        router_body, content_type = metrics.render()
        try:
            fleet_body = await fleet_metrics.arender()
        except Exception:  # the database away: say so, rather than half a fleet
            log.exception("/metrics: reading the fleet failed")
            raise V1Error(
                503, "fleet_unavailable", "The fleet's metrics could not be read; try again."
            ) from None
        body = router_body + fleet_body
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _authenticate(self, headers: dict[bytes, bytes], scope: Scope) -> Any:
        """The request's key; an address past its failed lookups is refused before lookup.

        A valid key costs one dictionary read here (none while no address is blocked);
        Redis is asked only after a lookup failed (core.throttle).
        """
        client = scope.get("client")
        host = client[0] if client else None
        wait = key_failures.blocked(host)
        if wait is not None:
            raise errors.too_many_failed_keys(wait)
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if not auth.lower().startswith("bearer "):
            raise errors.invalid_key()  # no key presented: nothing was guessed
        token = auth[7:].strip()
        key = await self.table.key(token)
        if key is None:
            verdict = await key_failures.arecord(
                host, where=scope["path"], prefix=key_prefix(token)
            )
            if verdict.refused:
                raise errors.too_many_failed_keys(verdict.retry_after or 1)
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
        prepared: transform.Prepared,
        request: Request,
    ) -> tuple[int, int] | None:
        """Send one request to one replica and stream the answer; returns the usage seen."""
        node = replica.node
        name = request.model
        context = await self._ssl_context(node)
        host, port = self._host(node.address)
        target = self._target(replica.instance_id, scope["path"], scope.get("query_string"))
        forward = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in headers.items()
            if k not in HOP_BY_HOP
        ]
        table = self.table
        table.in_flight[replica.instance_id] = table.in_flight.get(replica.instance_id, 0) + 1
        # The wait in the fair queue is the engine's time, not the router's.
        overhead = time.perf_counter() - request.started - (request.queue_wait or 0.0)
        # Idle time, not total: a stream may last an hour, but a partitioned or stopped
        # agent must not hold the request until the client gives up (docs/decisions.md D42).
        timeout = settings.MIRBAD.upstream_read_timeout
        try:
            try:
                response = await self.pool().request(
                    "POST", host, port, target, headers=forward, body=prepared.body,
                    ssl_context=context, read_timeout=timeout,
                )  # fmt: skip
            except ReadTimeout as exc:
                # Before ConnectFailed/OSError (it is a TimeoutError): the request reached
                # the agent and may be running, so it is not sent to another replica.
                log.warning("Node %s silent for %g s on %s: %s", node.node_id, timeout, name, exc)
                raise errors.upstream_timeout(name, node.node_id, timeout) from exc
            except (ConnectFailed, Disconnected, OSError) as exc:
                # Nothing of the answer arrived: another replica may take the request.
                log.warning("Node %s unreachable for %s: %s", node.node_id, name, exc)
                raise RetryableBeforeFirstByte(errors.node_unreachable(name, node.node_id)) from exc
            except WireError as exc:
                raise errors.upstream_unavailable(
                    f"Node '{node.node_id}' answered badly: {exc}"
                ) from exc
            async with response:
                header_start = time.perf_counter()
                agent_error = response.header(ERROR_HEADER)
                if agent_error:
                    await self._agent_error(response, agent_error, name, node.node_id)
                whole = WholeReader(response, name, node.node_id, timeout)
                prefetched = await whole.small() if response.status == 503 else None
                if prefetched is not None and b"oading" in prefetched:
                    # llama-server answers 503 "Loading model" while it (re)loads: nothing
                    # was sent to the client yet, so another replica may take it.
                    raise RetryableBeforeFirstByte(errors.model_not_ready(name))
                ok = 200 <= response.status < 300
                streamed = "text/event-stream" in (response.header("content-type") or "")
                length = response.content_length
                if not streamed and length is not None and length <= SMALL_ANSWER:
                    # A whole JSON answer of known small size: one read and one send, no
                    # pump and watcher tasks (there is nothing to stream incrementally).
                    prefetched = await whole.read()
                if ok and prepared.dimensions is not None:
                    # Emulated dimensions: the only answer the router rewrites whole.
                    body = prefetched if prefetched is not None else await whole.read()
                    prefetched = transform.transform_embeddings(prepared, body)
                out_headers = [
                    (lower, v)
                    for k, v in response.raw_headers
                    if (lower := k.lower()) not in HOP_BY_HOP and lower != AGENT_ERROR_BYTES
                ]
                if prefetched is not None:
                    out_headers = [h for h in out_headers if h[0] != b"content-length"]
                    out_headers.append((b"content-length", str(len(prefetched)).encode()))
                overhead += time.perf_counter() - header_start
                request.overhead = overhead
                out_headers.append((b"x-mirbad-overhead-ms", f"{overhead * 1000:.2f}".encode()))
                if request.queue_wait is not None:
                    out_headers.append((b"x-mirbad-queue-ms", _ms_of(request.queue_wait)))
                request.status = response.status
                if request.sse_started:
                    # The headers went out during the load (router.ondemand).
                    if not ok:
                        body = prefetched if prefetched is not None else await whole.read()
                        await send_sse_error(send, body)
                        return None
                else:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": response.status,
                            "headers": out_headers,
                        }
                    )
                request.ttfb = time.perf_counter() - request.started
                if prefetched is not None:
                    await send({"type": "http.response.body", "body": prefetched})
                    if not ok:
                        return None
                    sniffer = sse.UsageSniffer()
                    sniffer.feed(prefetched)
                    return sniffer.usage
                if ok and streamed:
                    events = sse.StreamFilter(injected_usage=prepared.injected_usage)
                    sent_done = False

                    def feed(chunk: bytes) -> bytes:
                        nonlocal sent_done
                        out = events.feed(chunk)
                        if b"[DONE]" in out:
                            sent_done = True
                        return out

                    try:
                        await stream(response, receive, send, feed, events.close, lambda: sent_done)
                    finally:
                        request.usage = events.usage  # tokens were spent even if it left
                    return events.usage
                sniffer = sse.UsageSniffer()
                try:
                    await stream(response, receive, send, tee(sniffer), None)
                finally:
                    request.usage = sniffer.usage
                return sniffer.usage
        finally:
            table.in_flight[replica.instance_id] -= 1

    async def _agent_error(
        self, response: WireResponse, code: str, name: str, node_id: str
    ) -> None:
        try:
            # An agent's error body is a line of JSON; a bigger one is not read whole.
            message = json.loads(await response.read(limit=65536))["error"]["message"]
        except Exception:
            message = code
        if code == AgentCode.MODEL_NOT_RUNNING:
            raise RetryableBeforeFirstByte(errors.model_not_ready(name))
        if code == AgentCode.SERVER_BUSY:
            raise V1Error(503, "server_busy", f"Node '{node_id}' is at its limit.", retry_after=5)
        if code == AgentCode.CLIENT_NOT_MASTER:
            raise errors.upstream_unavailable(f"Node '{node_id}' refused the master: {message}")
        raise errors.upstream_unavailable(message)


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
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(body: bytes) -> dict[str, Any]:
    """The request as a dict, with ``model`` checked (the one parse of the body)."""
    try:
        data = json.loads(body)
    except JSON_ERRORS as exc:
        raise V1Error(
            400, "invalid_request", f"The body must be a JSON object: {why_not_json(exc)}."
        ) from None
    if not isinstance(data, dict):
        raise V1Error(400, "invalid_request", "The body must be a JSON object.")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise V1Error(
            400, "invalid_request", "'model' is required: name a served model.", param="model"
        )
    if not is_text(model):
        # A lone surrogate (legal as a JSON \ud800 escape) or a NUL is no name a database
        # can hold.
        raise V1Error(400, "invalid_request", f"'model' {NOT_TEXT}.", param="model")
    return data


def _ms_of(seconds: float) -> bytes:
    return f"{seconds * 1000:.2f}".encode()


def _ms(started: float) -> bytes:
    return f"{(time.perf_counter() - started) * 1000:.2f}".encode()
