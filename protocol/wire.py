"""A lean HTTP/1.1 client for the proxy hops: pooled keep-alive connections, no frills.

Both hops of ``/v1`` (the master's router to the agent, the agent to its engine) send
one request and stream one answer back, millions of times. aiohttp's client does that
with a general machine (cookie jars, redirects, auto headers, payload registries,
multidict headers, tracing) that costs more CPU per request than the rest of each hop
together (docs/decisions.md D29). This module does only what the hops need:

- one asyncio ``Protocol`` per connection, httptools' C parser for the answer (it also
  undoes chunked encoding), the request head and a small body in one write;
- a pool of idle keep-alive connections per (host, port, TLS context), each given up
  after ``keepalive_seconds`` idle (an engine closes its own after a few seconds);
- an idle read timeout (no byte from the server for that long ends the request), a
  connect timeout, back-pressure both ways (reading pauses while the consumer lags);
- closing a response before its end aborts the connection, so the server sees the
  request go away at once (the router relies on it when its client leaves);
- a kept connection the server has closed costs no request: one whose end already
  arrived is dropped when picked, and a request on a reused connection that fails
  before any answer byte (its body in memory, so it can be sent again) is sent once
  more on a fresh connection. llama-server closes its side right after every streamed
  answer, without ``Connection: close``, so the race is there on every stream. A fresh
  connection's failure is the caller's: that server is really not answering
  (docs/decisions.md D39).

Errors: ``WireError`` and its subclasses, drawn in ``protocol.errors``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import select
import ssl
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

import httptools

from protocol.errors import BadResponse, ConnectFailed, Disconnected, ReadTimeout, WireError
from protocol.wire_response import WireResponse

__all__ = [
    "BadResponse",
    "ConnectFailed",
    "Disconnected",
    "ReadTimeout",
    "WireError",
    "WirePool",
    "WireResponse",
]

_BODY_CHUNK = 64 * 1024
# An answer's head (status line and headers) and header count: an engine's answer has
# a dozen headers; a server that sends more, or never ends its head, is cut off here
# instead of growing the parser's buffer (docs/decisions.md D40).
MAX_RESPONSE_HEAD = 64 * 1024
MAX_RESPONSE_HEADERS = 100


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    __slots__ = (
        "_codings",
        "_drain",
        "_head_bytes",
        "_interim",
        "_lost",
        "_parser",
        "_paused_writing",
        "closed",
        "idle_since",
        "key",
        "max_idle",
        "pool",
        "response",
        "retired",
        "transport",
    )

    def __init__(self, pool: WirePool, key: tuple[Any, ...]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: WireResponse | None = None
        self.closed = False
        self.retired = False  # its TLS context was retired: closed when its answer ends
        self.idle_since = 0.0
        self.max_idle = pool._max_idle  # idle connections kept for this key (per request)
        self._parser: Any = None
        self._paused_writing = False
        self._drain: asyncio.Future[None] | None = None
        self._lost: BaseException | None = None
        self._interim = False
        self._head_bytes = 0  # of the current answer, until its headers are complete
        self._codings: list[bytes] = []  # its Transfer-Encoding, coding by coding

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio.Protocol's signature says BaseTransport; a stream connection is always
        # handed a Transport (create_connection), which write and pause need.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            # Bytes while idle: the server is not speaking HTTP/1.1 keep-alive with us.
            self.abort()
            return
        response.last_read = time.monotonic()
        response.received = True
        in_head = not response.status
        try:
            self._parser.feed_data(data)
            response.flush()
            if in_head and not response.status and not response.done:
                # Still in the head after this read: count it (a head that ends in this
                # read may share it with body bytes, which must not count).
                self._head_bytes += len(data)
                if self._head_bytes > MAX_RESPONSE_HEAD:
                    response.fail(
                        BadResponse(f"the server's answer head is over {MAX_RESPONSE_HEAD} bytes")
                    )
                    self.abort()
        except httptools.HttpParserUpgrade:
            response.fail(BadResponse("the server switched protocols"))
            self.abort()
        except httptools.HttpParserError as exc:
            response.fail(BadResponse(f"the server's answer is not valid HTTP/1.1: {exc}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost ends the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost = exc
        self.pool._forget(self)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(Disconnected(f"the connection closed: {exc or 'EOF'}"))
        response = self.response
        if response is not None:
            response.connection_lost(exc)

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        if response is None or response.status:
            # A chunked answer's trailer: not a header. Appended, it would reach the
            # client as one when the router reads a small answer whole before its head.
            return
        headers = response.raw_headers
        if len(headers) <= MAX_RESPONSE_HEADERS:  # one more marks "too many"
            # The parser keeps a value's trailing whitespace, which is not part of it
            # (RFC 9110 5.5): "model_not_running " must still read as that agent error.
            value = value.strip(b" \t")
            headers.append((name, value))
            if len(name) == 17 and name.lower() == b"transfer-encoding":
                self._codings.extend(c.strip().lower() for c in value.split(b","))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        if len(response.raw_headers) > MAX_RESPONSE_HEADERS:
            response.fail(
                BadResponse(f"the server's answer has more than {MAX_RESPONSE_HEADERS} headers")
            )
            # Not from inside the parser's callback: the read that fed it closes it.
            asyncio.get_running_loop().call_soon(self.abort)
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim answer (100 Continue, 103 Early Hints): the final one follows.
            response.raw_headers.clear()
            self._codings.clear()
            self._interim = True
            return
        if self._codings and self._codings != [b"chunked"]:
            # Anything but one "chunked": the parser would read such a body to the
            # close still encoded (gzip, say), and the router drops Transfer-Encoding
            # as hop-by-hop, so its client would get bytes it cannot know to decode.
            # Refused as h11 refuses it, on every answer (a HEAD or 304 has no body, but
            # such a server's framing is not to be trusted for the next one).
            response.fail(
                BadResponse(
                    "the server's answer uses a transfer coding other than chunked, "
                    "which this client does not undo"
                )
            )
            asyncio.get_running_loop().call_soon(self.abort)
            return
        response.status = status
        response.headers_complete()
        if response.head_only:
            # A HEAD answer has no body, which the parser cannot know; end it here and
            # do not reuse the connection (the parser's state is past its reach).
            response.message_complete(keep_alive=False)

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None and not response.done:
            response.body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        response = self.response
        if response is not None and not response.done:
            response.message_complete(keep_alive=self._parser.should_keep_alive())

    # -- use ---------------------------------------------------------------------------

    def begin(self, response: WireResponse) -> None:
        self.response = response
        self._head_bytes = 0
        self._codings = []
        self._parser = httptools.HttpResponseParser(self)

    def finished(self, *, keep_alive: bool) -> None:
        """The current answer is complete: back to the pool, or closed."""
        self.response = None
        self._parser = None
        if keep_alive and not self.closed and not self.retired:
            self.idle_since = time.monotonic()
            self.pool._release(self)
        else:
            self.close()

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise Disconnected(f"the connection closed: {self._lost or 'EOF'}")
        if self._paused_writing:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def timed_out(self, error: BaseException) -> None:
        """The answer's read timeout expired: cut the connection, and a request still
        waiting to send its body fails with ``error``, not as a closed connection (which
        would read as a stale kept connection and be sent again)."""
        self.response = None
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(error)
        self.abort()


Body = bytes | AsyncIterator[bytes] | None


class WirePool:
    """Keep-alive connections by (host, port, TLS context); one request per connection."""

    def __init__(
        self,
        *,
        keepalive_seconds: float = 60.0,
        connect_timeout: float = 10.0,
        max_idle_per_host: int = 512,
    ) -> None:
        self._keepalive = keepalive_seconds
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle_per_host
        self._idle: dict[tuple[Any, ...], collections.deque[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._closed = False
        self.retries = 0  # requests sent again after a reused connection failed unanswered

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        body: Body = None,
        ssl_context: ssl.SSLContext | None = None,
        read_timeout: float | None = None,
        max_idle: int | None = None,
    ) -> WireResponse:
        """Send one request; returns once the answer's status and headers arrived.

        ``target`` is the path and query exactly as they go on the wire (already
        percent-encoded). ``headers`` must not carry Host, Content-Length,
        Transfer-Encoding or Connection: the request framing is this module's.
        ``max_idle`` caps the idle connections kept for this host and port once this
        answer ends (the pool's ``max_idle_per_host`` when None).

        A reused connection that fails before any answer byte is retried once on a
        fresh one when ``body`` is bytes or None (a streamed body is consumed as it is
        sent, so it cannot be sent twice).
        """
        if self._closed:
            raise WireError("the connection pool is closed")
        head = _head(method, target, host, port, headers, body)  # refuses bad headers first
        key = (host, port, id(ssl_context) if ssl_context is not None else None)
        cap = self._max_idle if max_idle is None else max_idle
        conn = self._take(key)
        if conn is not None:
            replayable = body is None or isinstance(body, bytes | bytearray | memoryview)
            response = await self._exchange(
                conn, method, head, body, read_timeout, cap, stale_is_none=replayable
            )
            if response is not None:
                return response
            # The server closed this kept connection as the request went out (its
            # keep-alive timeout, or its end not yet read here): nothing of it was
            # answered, so it goes again, once, on a connection of its own.
            self.retries += 1
            if self._closed:
                raise WireError("the connection pool is closed")
        conn = await self._connect(key, host, port, ssl_context)
        response = await self._exchange(
            conn, method, head, body, read_timeout, cap, stale_is_none=False
        )
        assert response is not None
        return response

    async def _exchange(
        self,
        conn: _Connection,
        method: str,
        head: bytes,
        body: Body,
        read_timeout: float | None,
        max_idle: int,
        *,
        stale_is_none: bool,
    ) -> WireResponse | None:
        """One request on ``conn`` up to its answer's headers. With ``stale_is_none``, a
        connection that closes before any answer byte returns None instead of raising."""
        conn.max_idle = max_idle
        response = WireResponse(conn, head_only=method == "HEAD", read_timeout=read_timeout)
        conn.begin(response)
        try:
            if isinstance(body, bytes | bytearray | memoryview):
                if len(body) <= _BODY_CHUNK:
                    conn.write(head + bytes(body))  # one write, one segment, the usual case
                else:
                    conn.write(head)
                    conn.write(bytes(body))
                    await conn.drain()
            elif body is None:
                conn.write(head)
            else:
                conn.write(head)
                await _send_chunked(conn, body)
            await response.wait_headers()
        except Disconnected:
            response.close()
            if stale_is_none and not response.received:
                return None
            raise
        except BaseException:
            response.close()
            raise
        return response

    def _take(self, key: tuple[Any, ...]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closed
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                self._all.discard(conn)
                continue
            if now - conn.idle_since > self._keepalive or _readable(conn.transport):
                # Too old, or the server's FIN (or stray bytes) already arrived and the
                # loop has not read it yet: reusing it would fail the request.
                self._forget(conn)
                conn.close()
                continue
            return conn
        return None

    async def _connect(
        self, key: tuple[Any, ...], host: str, port: int, context: ssl.SSLContext | None
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
        except TimeoutError:
            raise ConnectFailed(
                f"connecting to {host}:{port} took longer than {self._connect_timeout:g} s"
            ) from None
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        if conn.max_idle <= 0:
            conn.close()
            self._all.discard(conn)
            return
        idle = self._idle.setdefault(conn.key, collections.deque())
        while len(idle) >= conn.max_idle:
            # Over the cap: the longest idle goes, the nearest to its server's timeout.
            oldest = idle.popleft()
            self._all.discard(oldest)
            oldest.close()
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle:
            with contextlib.suppress(ValueError):
                idle.remove(conn)

    def retire(self, ssl_context: ssl.SSLContext) -> int:
        """Use no connection made with ``ssl_context`` again; returns how many there were.

        For a node whose pins changed or that was revoked: its idle connections close
        now, and one carrying a request closes when that answer ends, instead of
        waiting in the pool for the keep-alive time. New requests under a new context
        get connections of their own (the pool keys connections by context).
        """
        tag = id(ssl_context)
        matched = [conn for conn in self._all if conn.key[2] == tag]
        for conn in matched:
            conn.retired = True
            if conn.response is None:  # idle
                self._forget(conn)
                conn.close()
        return len(matched)

    async def close(self) -> None:
        """Close every connection, idle or busy."""
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks

    @property
    def connections(self) -> int:
        """Open connections (idle and busy), for tests and metrics."""
        return len(self._all)


def _head(
    method: str,
    target: str,
    host: str,
    port: int,
    headers: Iterable[tuple[str, str]],
    body: Body,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {_host(host)}:{port}\r\n"]
    for name, value in headers:
        if "\n" in name or "\r" in name or "\n" in value or "\r" in value:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    if isinstance(body, bytes | bytearray | memoryview):
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
    elif body is None:
        lines.append("Content-Length: 0\r\n\r\n" if method in ("POST", "PUT", "PATCH") else "\r\n")
    else:
        lines.append("Transfer-Encoding: chunked\r\n\r\n")
    return "".join(lines).encode("latin-1")


def _readable(transport: asyncio.Transport) -> bool:
    """Whether an idle connection's socket has something to read: its end, a reset, or
    bytes the server may not send unasked. One poll(2) with no wait."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def _send_chunked(conn: _Connection, body: AsyncIterator[bytes]) -> None:
    async for piece in body:
        if not piece:
            continue
        for start in range(0, len(piece), _BODY_CHUNK):
            part = piece[start : start + _BODY_CHUNK]
            conn.write(b"%x\r\n%b\r\n" % (len(part), part))
            await conn.drain()
    conn.write(b"0\r\n\r\n")
