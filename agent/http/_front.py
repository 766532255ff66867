"""The agent's listener: proxy requests on a lean protocol, everything else on aiohttp.

A /v1 request crosses the agent twice (request in, answer out), and on the first
streamed chunk every microsecond there is latency the client sees. Behind aiohttp's
server (request objects, four middlewares, the router, StreamResponse) the agent spent
about as long on a proxied request as the master's router did (D32). So each
connection starts on ``ProxyFront``, which parses with httptools:

- a request for ``/agent/v1/proxy/{id}/...`` (HTTP/1.1, no ``Expect``, no upgrade) is
  relayed here, through the same ``Proxy`` core as aiohttp's route: admission and the
  in-flight limit, the engine's connection pool, the idle timeout, the error bodies;
- any other request hands the connection to aiohttp's protocol for good, with every
  byte read so far: the control API keeps its middlewares (client certificate,
  fencing, operation log) and aiohttp's complete HTTP handling.

The master's client certificate is checked for proxy requests here as the middleware
checks it for the rest (one verdict per TLS connection, shared). The listener limits
(``protocol.http_limits``: head size and header count, head and body deadlines, open
connections) apply here to every connection, and go on applying after a hand-off,
through a ``GuardedProtocol`` in front of aiohttp's. Pipelined requests
are not served on this path: the connection closes after the answer in progress, and
the client sends the next request again (the router never pipelines).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import httptools

from agent._errors import (
    ERROR_HEADER,
    ApiError,
    ClientNotMaster,
    UpstreamUnavailable,
)
from agent.http._proxy import (
    SMALL_BODY,
    Proxy,
    StreamBroken,
    Upstream,
    relay_mode,
    request_headers,
    response_headers,
    split_target,
)
from agent.identity import handshake_refusal
from protocol.http_limits import (
    KEEPALIVE_SECONDS,
    ConnectionGate,
    GuardedProtocol,
    HeadGuard,
    HttpLimits,
    Refused,
    answer_and_close,
)
from protocol.wire import WireResponse

__all__ = ["FrontListener", "ProxyFront"]

log = logging.getLogger("mirbad.agent.proxy")

PREFIX = b"/agent/v1/proxy/"
ERROR_HEADER_BYTES = ERROR_HEADER.encode()
READ_PAUSE = 1024 * 1024  # a streamed upload stops reading above this much buffered

Verdict = Callable[[asyncio.BaseTransport], str | None]


class _Stop(Exception):
    """Raised from a parser callback to stop parsing (hand-off or pipelining)."""


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


def _head(status: int, headers: list[tuple[str, str]], extra: bytes, *, keep_alive: bool) -> bytes:
    lines = [_status_line(status)]
    lines.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers)
    lines.append(extra)
    if not keep_alive:
        lines.append(b"Connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Request:
    """One proxied request while it is read: head, then the body as it arrives."""

    __slots__ = (
        "chunks",
        "complete",
        "has_body",
        "headers",
        "keep_alive",
        "length",
        "method",
        "url",
        "waiter",
    )

    def __init__(
        self, method: str, url: str, headers: list[tuple[str, str]], *, keep_alive: bool
    ) -> None:
        self.keep_alive = keep_alive
        self.method = method
        self.url = url
        self.headers = headers
        self.length: int | None = None
        self.has_body = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.complete = False  # the whole request was read
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class ProxyFront(asyncio.Protocol):
    """One client connection, as described in the module docstring."""

    def __init__(
        self,
        *,
        proxy: Proxy,
        fallback: Callable[[], asyncio.Protocol],
        verdict: Verdict,
        owner: FrontListener | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self._proxy = proxy
        self._limits = limits or HttpLimits()
        self._guard: HeadGuard | None = None
        self._admitted = False  # holds a slot of the owner's gate
        self._fallback = fallback
        self._verdict = verdict
        self._owner = owner
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._raw = bytearray()  # the bytes of a request not yet ours (for a hand-off)
        self._url = bytearray()
        self._headers: list[tuple[str, str]] = []
        self._request: _Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._handoff = False
        self._pipelined = False
        self._read_paused = False
        self._write_paused = False
        self._piped: WireResponse | None = None  # the engine answer being piped here
        self._lost = False
        self._head_written = False  # of the answer in progress
        self._idle: asyncio.TimerHandle | None = None
        self._refused = False  # answered a refusal: nothing more is read

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is not an asyncio.Transport subclass, but it is one.
        self.transport = cast(asyncio.Transport, transport)
        if handshake_refusal(transport.get_extra_info("ssl_object")) is not None:
            # The TLS handshake failed: the verdict logs it, and the close sends the
            # alert (agent.identity._tls._AlertingSSLObject). Nothing is read from it.
            self._verdict(transport)
            self.transport.close()
            return
        if self._owner is not None:
            if not self._owner.gate.admit():
                self._refused = True
                answer_and_close(transport, 503, "the listener has too many connections")
                return
            self._admitted = True
            self._owner.connections.add(self)
        self._guard = HeadGuard(self._limits, transport, self._expired)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing() or self._refused:
            return  # refused and closing: nothing more is read
        if self._request is None:
            self._raw += data
        guard = self._guard
        assert guard is not None
        try:
            self._parser.feed_data(data)
            guard.after_feed(len(data))
        except Refused as exc:
            self._refuse(exc)
            return
        except httptools.HttpParserCallbackError:
            if guard.refusal is not None:
                self._refuse(guard.refusal)
                return
            if self._handoff:
                self._hand_off()
                return
            if not self._pipelined:
                raise
        except httptools.HttpParserError as exc:
            if self._request is None and not self.busy:
                self._answer_bad_request(400, f"bad HTTP request: {exc}")
            else:
                self.abort()
            return

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_idle()
        if self._guard is not None:
            self._guard.close()
        if self._owner is not None:
            if self._admitted:
                self._admitted = False
                self._owner.gate.release()
            self._owner.connections.discard(self)
            self._owner.changed()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: the engine's request is dropped
        if self._request is not None:
            self._request.wake()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._piped is not None:
            self._piped.hold(True)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._piped is not None:
            self._piped.hold(False)

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.busy or self._request is not None:
            self._pipelined = True
            raise _Stop
        assert self._guard is not None
        self._guard.message_begin()
        self._url.clear()
        self._headers = []

    def on_url(self, url: bytes) -> None:
        assert self._guard is not None
        self._guard.url(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._guard is not None
        self._guard.header(name, value)
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        assert self._guard is not None
        self._guard.headers_done()
        parser = self._parser
        if (
            not self._url.startswith(PREFIX)
            or parser.get_http_version() != "1.1"
            or parser.should_upgrade()
            or any(name.lower() == "expect" for name, _ in self._headers)
        ):
            self._handoff = True
            raise _Stop
        self._cancel_idle()  # until here the keep-alive timer also bounds reading the head
        request = _Request(
            parser.get_method().decode(),
            self._url.decode("latin-1"),
            self._headers,
            keep_alive=parser.should_keep_alive(),
        )
        for name, value in self._headers:
            lower = name.lower()
            if lower == "content-length":
                request.length = int(value)  # httptools has checked it is a number
            elif lower == "transfer-encoding":
                request.has_body = True
        request.has_body = request.has_body or bool(request.length)
        self._request = request
        self._raw = bytearray()
        self._task = asyncio.get_running_loop().create_task(self._serve(request))
        if self._owner is not None:
            owner = self._owner
            self._task.add_done_callback(lambda _: owner.changed())

    def on_body(self, body: bytes) -> None:
        request = self._request
        if request is None:
            return
        request.chunks.append(body)
        request.wake()
        if (
            (request.length is None or request.length > SMALL_BODY)
            and not self._read_paused
            and sum(map(len, request.chunks)) > READ_PAUSE
        ):
            self._read_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        assert self._guard is not None
        self._guard.message_done()
        request = self._request
        if request is not None:
            request.complete = True
            request.wake()

    # -- serving -------------------------------------------------------------------------

    async def _serve(self, request: _Request) -> None:
        keep_alive = request.keep_alive
        try:
            try:
                refusal = self._verdict(self.transport) if self.transport else "no transport"
                if refusal is not None:
                    self._write_error(
                        ClientNotMaster(f"only the master may call the agent: {refusal}"),
                        keep_alive=False,
                    )
                    return
                instance_id, target = split_target(request.url)
                upstream = self._proxy.admit(instance_id)
            except ApiError as exc:
                self._write_error(exc, keep_alive=keep_alive)
                return
            try:
                await self._forward(request, upstream, target, keep_alive)
            finally:
                self._proxy.release()
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("Unexpected error on %s %s", request.method, request.url)
            if self._head_written:
                self.abort()
            else:
                self._write_error(ApiError("unexpected agent error; see its log"), keep_alive=False)
        finally:
            self._finish(request)

    async def _forward(
        self, request: _Request, upstream: Upstream, target: str, keep_alive: bool
    ) -> None:
        headers = request_headers(request.headers, upstream.key)
        body: AsyncIterator[bytes] | bytes | None = None
        if request.has_body:
            if request.length is not None and request.length <= SMALL_BODY:
                body = await self._whole_body(request)
            else:
                body = self._stream_body(request)
        try:
            response = await self._proxy.open(upstream, request.method, target, headers, body)
        except ApiError as exc:
            self._write_error(exc, keep_alive=keep_alive)
            return
        try:
            await self._relay(request, response, upstream, keep_alive)
        finally:
            response.close()

    async def _relay(
        self, request: _Request, response: WireResponse, upstream: Upstream, keep_alive: bool
    ) -> None:
        status = response.status
        mode = relay_mode(request.method, response)
        if mode == "empty":
            self._write(
                _head(
                    status,
                    response_headers(response, frozenset()),
                    b"",
                    keep_alive=self._keeps(keep_alive),
                )
            )
            return
        if mode == "whole":
            try:
                whole = await self._proxy.read_whole(response, upstream)
            except UpstreamUnavailable as exc:
                self._write_error(exc, keep_alive=keep_alive)
                return
            headers = response_headers(response, frozenset({"content-length"}))
            extra = b"Content-Length: %d\r\n" % len(whole)
            self._write(_head(status, headers, extra, keep_alive=self._keeps(keep_alive)) + whole)
            return
        headers = response_headers(response, frozenset({"content-length"}))
        head = _head(
            status, headers, b"Transfer-Encoding: chunked\r\n", keep_alive=self._keeps(keep_alive)
        )
        # An engine that sent its first chunk with its headers (llama-server does) gets
        # both forwarded in one write: the router then wakes once, not twice.
        first = response.take_buffered()
        self._write(head + _chunk(first) if first else head)
        # The rest goes from the engine connection's read straight to this one's write
        # (D51); a full send buffer here holds the engine's reading, not a task.
        self._piped = response
        if self._write_paused:
            response.hold(True)
        try:
            await self._proxy.pipe_stream(response, upstream, self._write_chunk)
        except StreamBroken:
            self.abort()
            return
        finally:
            self._piped = None
        self._write(b"0\r\n\r\n")

    def _write_chunk(self, data: bytes) -> None:
        if self.transport is not None and not self._lost:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def _whole_body(self, request: _Request) -> bytes:
        while not request.complete:
            await self._wait(request)
        return b"".join(request.chunks)

    async def _stream_body(self, request: _Request) -> AsyncIterator[bytes]:
        while True:
            while request.chunks:
                chunk = request.chunks.popleft()
                if self._read_paused and sum(map(len, request.chunks)) < READ_PAUSE // 2:
                    self._read_paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                yield chunk
            if request.complete:
                return
            await self._wait(request)

    async def _wait(self, request: _Request) -> None:
        if self._lost:
            raise ConnectionResetError("the client closed the connection")
        request.waiter = asyncio.get_running_loop().create_future()
        try:
            await request.waiter
        finally:
            request.waiter = None

    def _finish(self, request: _Request) -> None:
        """After an answer: ready for the next request, or closed."""
        if self._lost or self.transport is None or self.transport.is_closing():
            return
        if not request.complete or self._pipelined or not request.keep_alive:
            # Unread request bytes (or a pipelined request) would be read as the next one.
            self.transport.close()
            return
        self._request = None
        self._raw = bytearray()
        self._head_written = False
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
        self._arm_idle()

    # -- writing -------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self._lost:
            self._head_written = True
            self.transport.write(data)

    def _keeps(self, keep_alive: bool) -> bool:
        """Whether the answer being written leaves the connection open."""
        return keep_alive and not self._pipelined

    def _write_error(self, error: ApiError, *, keep_alive: bool) -> None:
        keep_alive = self._keeps(keep_alive)
        body = json.dumps(error.to_json()).encode()
        extra = (
            b"Content-Type: application/json; charset=utf-8\r\n"
            b"Content-Length: %d\r\n%b: %b\r\n"
            % (len(body), ERROR_HEADER_BYTES, error.code.encode())
        )
        self._write(_head(error.status, [], extra, keep_alive=keep_alive) + body)
        if not keep_alive and self.transport is not None:
            self.transport.close()

    def _answer_bad_request(self, status: int, message: str) -> None:
        if self.transport is not None and not self._lost:
            self._refused = True
            self._head_written = True
            answer_and_close(self.transport, status, message)

    def _refuse(self, refused: Refused) -> None:
        """A limit was broken: answer it unless an answer is being written, and close."""
        if self._head_written:
            self.abort()
        else:
            self._answer_bad_request(refused.status, refused.message)

    def _expired(self, status: int | None, message: str) -> None:
        """A head or body deadline passed (see ``HeadGuard``)."""
        if self.transport is None or self.transport.is_closing():
            return
        log.debug("Closing a connection: %s", message)
        if status is not None and not self.busy and not self._head_written:
            self._answer_bad_request(status, message)
        elif self.busy:
            self.abort()  # the relay in progress ends with the connection
        else:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.abort()

    # -- hand-off and idle connections -----------------------------------------------

    def _hand_off(self) -> None:
        """Give this connection, and what it sent so far, to aiohttp's protocol."""
        transport = self.transport
        assert transport is not None
        self._cancel_idle()
        if self._guard is not None:
            self._guard.close()
        gate = None
        if self._owner is not None:
            self._owner.connections.discard(self)
            gate = self._owner.gate
        # The limits go on for the connection's life; its slot in the gate goes with it.
        protocol = GuardedProtocol(self._fallback(), self._limits, gate, admitted=self._admitted)
        self._admitted = False
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self._read_paused:
            transport.resume_reading()
        protocol.data_received(bytes(self._raw))
        self._raw = bytearray()

    def _arm_idle(self) -> None:
        self._cancel_idle()
        self._idle = asyncio.get_running_loop().call_later(KEEPALIVE_SECONDS, self.close_idle)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def close_idle(self) -> None:
        """Close the connection if no request is on it (keep-alive timeout, shutdown)."""
        if not self.busy and self._request is None and self.transport is not None:
            self.transport.close()


class FrontListener:
    """The agent's listening socket with ``ProxyFront`` on every connection."""

    def __init__(
        self,
        *,
        proxy: Proxy,
        fallback: Callable[[], asyncio.Protocol],
        verdict: Verdict,
        limits: HttpLimits | None = None,
    ) -> None:
        self._proxy = proxy
        self._fallback = fallback
        self._verdict = verdict
        self.limits = limits or HttpLimits()
        self.gate = ConnectionGate(self.limits.max_connections)  # fronts and handed-off ones
        self._server: asyncio.Server | None = None
        self._changed = asyncio.Event()
        self.connections: set[ProxyFront] = set()

    def _protocol(self) -> ProxyFront:
        return ProxyFront(
            proxy=self._proxy,
            fallback=self._fallback,
            verdict=self._verdict,
            owner=self,
            limits=self.limits,
        )

    async def start(self, host: str | None, port: int, *, ssl: Any = None) -> int:
        """Listen; returns the port (the one picked when ``port`` is 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol,
            host or None,
            port,
            ssl=ssl,
            # A TLS handshake is part of reaching the first request head: same deadline.
            ssl_handshake_timeout=self.limits.head_timeout_seconds if ssl is not None else None,
            backlog=128,
            reuse_address=True,
        )
        return int(self._server.sockets[0].getsockname()[1])

    def changed(self) -> None:
        """A connection finished an answer or closed (what ``close()`` waits for)."""
        self._changed.set()

    async def close(self, grace_seconds: float) -> None:
        """Stop listening, let proxied answers in progress finish for up to
        ``grace_seconds``, then cut what is left. Connections handed to aiohttp are its
        runner's to close."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for front in list(self.connections):
            front.close_idle()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_seconds):
                while any(front.busy for front in self.connections):
                    self._changed.clear()
                    await self._changed.wait()
        for front in list(self.connections):
            front.abort()
        self.connections.clear()
