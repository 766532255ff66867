"""Limits every HTTP listener applies before it knows who is calling.

A request head is read before any key or certificate role is checked, so without
bounds one client could make a listener hold megabytes of header bytes, keep
hundreds of connections open by sending a byte every few seconds (slowloris), or
pin a request by promising a body it never sends. The rules, the same for the
master's web port, its enroll listener and the agent (docs/operator-guide.md,
"Limits"):

- a request head (request line and headers) over ``max_head_bytes``, or with more
  than ``max_headers`` headers, is answered ``431`` and the connection closed;
- a head must be complete ``head_timeout_seconds`` after its first byte (on a new
  connection: after the connection opened), else ``408`` and close;
- while a request body is expected, ``body_idle_timeout_seconds`` without a body
  byte closes the connection (the time the server itself stops reading, because
  the application is slow to consume, does not count);
- a listener holds at most ``max_connections`` connections; one more is answered
  ``503`` at once and closed.

:class:`HeadGuard` is the rule set for one connection, driven by the httptools
callbacks of whichever protocol parses it (uvicorn's, the agent's lean front, or
:class:`GuardedProtocol`, which parses a copy of the stream in front of aiohttp's
protocol). This module is Django-free and part of the protocol package both sides import.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import httptools

__all__ = [
    "KEEPALIVE_SECONDS",
    "ConnectionGate",
    "GuardedProtocol",
    "HeadGuard",
    "HttpLimits",
    "Refused",
    "aiohttp_handler_limits",
    "answer_and_close",
    "refusal",
]

KEEPALIVE_SECONDS = 75.0  # an idle keep-alive connection (aiohttp 3.14's default is 3630 s)
LINGER_SECONDS = 1.0  # a refused client's time to read the answer before the socket closes

# Bytes a header line adds beyond its name and value: ": " and CRLF.
_HEADER_OVERHEAD = 4

# What each refusal says in the JSON body's ``code``; 431 keeps the agent's
# existing ``invalid_request`` (docs/agent-api.md).
_CODES = {
    400: "invalid_request",
    408: "request_timeout",
    431: "invalid_request",
    503: "server_busy",
}


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """One listener's limits (the module docstring says what each bounds)."""

    max_head_bytes: int = 64 * 1024
    max_headers: int = 100
    head_timeout_seconds: float = 10.0
    body_idle_timeout_seconds: float = 30.0
    max_connections: int = 1000


class Refused(Exception):
    """A request broke a limit; the connection is answered ``status`` and closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def refusal(status: int, message: str) -> bytes:
    """A complete ``Connection: close`` answer with the JSON error body of the APIs."""
    code = _CODES.get(status, "invalid_request")
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    phrase = http.HTTPStatus(status).phrase
    extra = b"Retry-After: 1\r\n" if status == 503 else b""
    return (
        b"HTTP/1.1 %d %b\r\n"
        b"Content-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\n%bConnection: close\r\n\r\n%b"
        % (status, phrase.encode(), len(body), extra, body)
    )


def answer_and_close(transport: asyncio.BaseTransport, status: int, message: str) -> None:
    """Answer :func:`refusal` and close, so that a client still sending can read it.

    Closing a socket with unread bytes in it sends a reset, and a client still
    writing its oversized head would then see "connection reset" instead of the
    answer. So the answer goes out with a FIN where the transport can half-close,
    reading stops (what the client sends waits in the kernel, not in our memory),
    and the socket is closed ``LINGER_SECONDS`` later.
    """
    stream = cast(asyncio.Transport, transport)
    if stream.is_closing():
        return
    stream.write(refusal(status, message))
    with contextlib.suppress(Exception):  # a transport that cannot do either just closes
        stream.pause_reading()
    if stream.can_write_eof():
        stream.write_eof()
    asyncio.get_running_loop().call_later(LINGER_SECONDS, stream.close)


def aiohttp_handler_limits(limits: HttpLimits) -> dict[str, Any]:
    """aiohttp ``RequestHandler`` keyword arguments matching ``limits``.

    A guard in front of aiohttp refuses first (with 431); these are the second net,
    set no tighter so that aiohttp's own 400 never pre-empts the guard's answer.
    """
    return {
        "max_line_size": limits.max_head_bytes,
        "max_field_size": limits.max_head_bytes,
        "max_headers": limits.max_headers,
        "keepalive_timeout": KEEPALIVE_SECONDS,
    }


class ConnectionGate:
    """The open-connection count of one listener."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def admit(self) -> bool:
        """Take a slot; False when the listener is full (the caller refuses)."""
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open = max(0, self.open - 1)


_IDLE, _HEAD, _BODY = 0, 1, 2


def _reading(transport: asyncio.BaseTransport) -> bool:
    is_reading = getattr(transport, "is_reading", None)
    return bool(is_reading()) if is_reading is not None else True


class HeadGuard:
    """The limits on one connection, fed by its parser's callbacks.

    ``url``, ``header`` and ``headers_done`` raise :class:`Refused` from inside the
    parser (httptools turns it into ``HttpParserCallbackError``; ``refusal`` keeps
    it); ``after_feed`` raises it after each chunk. Timers are armed only while a
    head or body is incomplete after a chunk, so a request that arrives whole costs
    no timer at all. ``expire(status, message)`` is called when a deadline passes:
    ``status`` is 408 for a head that had begun, None when nothing is owed (a
    connection that never sent a byte, a body that stopped).
    """

    __slots__ = (
        "_began_in_chunk",
        "_counted",
        "_ended_in_chunk",
        "_expire",
        "_head_bytes",
        "_headers",
        "_last_body",
        "_limits",
        "_loop",
        "_max_head",
        "_max_headers",
        "_phase",
        "_seen",
        "_started",
        "_timer",
        "_transport",
        "refusal",
    )

    def __init__(
        self,
        limits: HttpLimits,
        transport: asyncio.BaseTransport,
        expire: Callable[[int | None, str], None],
    ) -> None:
        self._limits = limits
        # Read on every header: plain attributes, not a lookup through ``limits``.
        self._max_head = limits.max_head_bytes
        self._max_headers = limits.max_headers
        self._transport = transport
        self._expire = expire
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self.refusal: Refused | None = None
        # A new connection is in its first head from the start: a client that connects
        # and sends nothing is bounded by the head deadline too.
        self._phase = _HEAD
        self._started: float | None = self._loop.time()  # None: the head began this chunk
        self._seen = False  # a byte of the current head has arrived
        self._began_in_chunk = False
        self._ended_in_chunk = False
        self._counted = 0  # exact bytes of the url and completed headers
        self._head_bytes = 0  # bytes of the chunks that hold nothing but this head
        self._headers = 0
        self._last_body = 0.0
        self._arm(limits.head_timeout_seconds)

    # -- parser callbacks ----------------------------------------------------------

    def message_begin(self) -> None:
        if self._phase != _HEAD:
            self._phase = _HEAD
            self._started = None  # the clock is read only if a timer is needed
            if self._timer is not None:
                self._cancel()
        self._seen = True
        self._began_in_chunk = True
        self._counted = 0
        self._head_bytes = 0
        self._headers = 0

    def url(self, size: int) -> None:
        self._counted += size
        if self._counted > self._max_head:
            self._refuse_size()

    def header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        self._counted += len(name) + len(value) + _HEADER_OVERHEAD
        if self._headers > self._max_headers or self._counted > self._max_head:
            if self._headers > self._max_headers:
                self._refuse(431, f"the request has more than {self._max_headers} headers")
            self._refuse_size()

    def headers_done(self) -> None:
        if self._counted > self._max_head:
            self._refuse_size()
        self._phase = _BODY
        if self._timer is not None:
            self._cancel()

    def message_done(self) -> None:
        self._phase = _IDLE
        self._ended_in_chunk = True
        if self._timer is not None:
            self._cancel()

    # -- after each chunk ----------------------------------------------------------

    def after_feed(self, size: int) -> None:
        """Account for a chunk the parser took whole; raises :class:`Refused`."""
        shared = self._began_in_chunk and self._ended_in_chunk
        self._began_in_chunk = self._ended_in_chunk = False
        if self._phase == _IDLE:
            return  # the usual case: every message in the chunk was whole
        if self._phase == _HEAD:
            self._seen = self._seen or size > 0
            # An unfinished head is the end of its chunk, so the chunk counts whole, except
            # when the previous message ended in it too (pipelining): then only the exact
            # count of the url and completed headers does. Both are lower bounds of the
            # head's size, and at most one chunk more than the limit is ever held.
            if not shared:
                self._head_bytes += size
            if max(self._counted, self._head_bytes) > self._max_head:
                self._refuse_size()
            if self._timer is None:
                now = self._loop.time()
                if self._started is None:
                    self._started = now
                self._arm(self._started + self._limits.head_timeout_seconds - now)
        else:
            self._last_body = self._loop.time()
            if self._timer is None:
                self._arm(self._limits.body_idle_timeout_seconds)

    def close(self) -> None:
        """The connection is gone or no longer HTTP/1.1 (an upgrade): stop the timers."""
        self._phase = _IDLE
        self._cancel()

    # -- internals -----------------------------------------------------------------

    def _refuse_size(self) -> None:
        self._refuse(431, f"the request head is over {self._max_head} bytes")

    def _refuse(self, status: int, message: str) -> None:
        self.refusal = Refused(status, message)
        self.close()
        raise self.refusal

    def _arm(self, delay: float) -> None:
        self._cancel()
        self._timer = self._loop.call_later(max(delay, 0.0), self._fire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        if self._phase == _HEAD:
            if not _reading(self._transport):
                # We stopped reading (a pipelined request waits): not the client's delay.
                self._arm(self._limits.head_timeout_seconds)
                return
            self._phase = _IDLE
            if self._seen:
                limit = self._limits.head_timeout_seconds
                self._expire(408, f"the request head was not complete within {limit:g} s")
            else:
                self._expire(None, "no request within the head deadline")
        elif self._phase == _BODY:
            idle = self._limits.body_idle_timeout_seconds
            if not _reading(self._transport):
                self._last_body = now  # the application is slow to read, not the client
            if now - self._last_body < idle:
                self._arm(self._last_body + idle - now)
                return
            self._phase = _IDLE
            self._expire(None, f"no request body byte for {idle:g} s")


class GuardedProtocol(asyncio.Protocol):
    """Applies :class:`HeadGuard` and a :class:`ConnectionGate` in front of another
    protocol (aiohttp's ``RequestHandler``), on a copy of the bytes it is given.

    The inner protocol gets the real transport, so TLS details, flow control and
    closing are its own; this one only reads along and cuts the connection when a
    limit is broken, before the inner protocol has seen the offending bytes.
    """

    def __init__(
        self,
        inner: asyncio.Protocol,
        limits: HttpLimits,
        gate: ConnectionGate | None,
        *,
        admitted: bool = False,
    ) -> None:
        self._inner = inner
        self._limits = limits
        self._gate = gate
        self._holds_slot = admitted  # a slot taken by whoever handed the connection over
        self._parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            # A request after one that asked to close is the inner protocol's to ignore.
            self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._guard: HeadGuard | None = None
        self._transport: asyncio.Transport | None = None
        self._started = False
        self._passthrough = False
        self._closing = False  # refused: nothing more is read or passed on

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if not self._holds_slot and self._gate is not None:
            if not self._gate.admit():
                answer_and_close(transport, 503, "the listener has too many connections")
                return
            self._holds_slot = True
        self._guard = HeadGuard(self._limits, transport, self._expired)
        self._started = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._started or self._closing or self._transport is None:
            return
        guard = self._guard
        assert guard is not None
        if not self._passthrough:
            try:
                self._parser.feed_data(data)
                guard.after_feed(len(data))
            except Refused as exc:
                self._refuse(exc.status, exc.message)
                return
            except httptools.HttpParserUpgrade:
                # The inner protocol owns an upgraded connection (no HTTP/1.1 after it).
                self._passthrough = True
                guard.close()
            except httptools.HttpParserError as exc:
                if guard.refusal is not None:
                    self._refuse(guard.refusal.status, guard.refusal.message)
                else:
                    self._refuse(400, f"bad HTTP request: {exc}")
                return
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self._started:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._guard is not None:
            self._guard.close()
        if self._holds_slot and self._gate is not None:
            self._holds_slot = False
            self._gate.release()
        if self._started:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._started:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._started:
            self._inner.resume_writing()

    # -- httptools callbacks (the guard's view of the stream) ----------------------

    def on_message_begin(self) -> None:
        assert self._guard is not None
        self._guard.message_begin()

    def on_url(self, url: bytes) -> None:
        assert self._guard is not None
        self._guard.url(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._guard is not None
        self._guard.header(name, value)

    def on_headers_complete(self) -> None:
        assert self._guard is not None
        self._guard.headers_done()

    def on_message_complete(self) -> None:
        assert self._guard is not None
        self._guard.message_done()

    # -- refusing --------------------------------------------------------------------

    def _refuse(self, status: int, message: str) -> None:
        if self._guard is not None:
            self._guard.close()
        self._closing = True
        if self._transport is not None:
            answer_and_close(self._transport, status, message)

    def _expired(self, status: int | None, message: str) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._closing = True
        if status is not None:
            answer_and_close(transport, status, message)
        else:
            transport.close()
