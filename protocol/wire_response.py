"""One answer on a wire connection: status and headers, then the body as it arrives.

Split from ``protocol.wire`` (the connection protocol and the pool): this is the
consumer's side of an answer, with its buffering, back-pressure thresholds and the
idle read timeout that does not count our own pauses (docs/decisions.md D29).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from protocol.errors import BadResponse, Disconnected, ReadTimeout

if TYPE_CHECKING:
    from protocol.wire import _Connection

__all__ = ["MAX_WHOLE_BODY", "WireResponse"]

_HIGH_WATER = 256 * 1024  # buffered answer bytes above which reading pauses
# The most a whole-body read() takes by default: a streamed answer is never held whole,
# and the answers read whole (embeddings to rewrite, error bodies) are far smaller.
MAX_WHOLE_BODY = 256 * 1024 * 1024


class WireResponse:
    """One answer: status and headers first, then the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_error",
        "_headers",
        "_limit",
        "_paused",
        "_sink",
        "_started",
        "_timeout",
        "_timer",
        "_waiter",
        "_whole",
        "done",
        "head_only",
        "last_read",
        "raw_headers",
        "received",
        "status",
    )

    def __init__(self, conn: _Connection, *, head_only: bool, read_timeout: float | None) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head_only = head_only
        self.done = False  # the whole answer arrived (or failed)
        self.last_read = time.monotonic()
        self.received = False  # any byte of the answer arrived (then it is never resent)
        self._conn: _Connection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._whole = False
        self._limit = MAX_WHOLE_BODY
        self._timeout = read_timeout
        self._timer: asyncio.TimerHandle | None = None
        self._headers: dict[str, str] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._started = False  # headers complete
        if read_timeout:
            self._timer = asyncio.get_running_loop().call_later(read_timeout, self._check_idle)

    # -- what callers read ---------------------------------------------------------------

    @property
    def headers(self) -> dict[str, str]:
        """Headers by lowercase name (repeated ones joined with ', ', as HTTP allows)."""
        if self._headers is None:
            out: dict[str, str] = {}
            for name, value in self.raw_headers:
                key = name.decode("latin-1").lower()
                text = value.decode("latin-1")
                out[key] = f"{out[key]}, {text}" if key in out else text
            self._headers = out
        return self._headers

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    @property
    def content_length(self) -> int | None:
        raw = self.headers.get("content-length")
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None

    def at_eof(self) -> bool:
        """Whether the whole body arrived and was taken by the caller."""
        return self.done and self._error is None and not self._chunks

    async def read(self, limit: int = MAX_WHOLE_BODY) -> bytes:
        """The rest of the body, whole; BadResponse (and the connection cut) past ``limit``."""
        self._limit = limit
        length = self.content_length
        if not self.done and ((length is not None and length > limit) or self._buffered > limit):
            self._too_large()
        self._whole = True  # the caller takes it all at once: no reason to pause reading
        self._resume()
        while not self.done:
            await self._wait()
        if self._error is not None:
            raise self._error
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    def take_buffered(self) -> bytes:
        """What of the body has arrived and was not taken yet, without waiting (maybe b"")."""
        if not self._chunks:
            return b""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._resume()
        return data

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Everything that arrived since the last step, as soon as it arrives."""
        while True:
            if self._chunks:
                yield self.take_buffered()
                continue
            if self.done:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    async def pipe(self, sink: Callable[[bytes], None]) -> None:
        """Hand the rest of the body to ``sink`` as it arrives; return at its end.

        ``sink`` is called from the connection's read callback, once per read with all
        that read brought (a lone chunk at once, waiting chunks together), so no task
        switch stands between a chunk's arrival and its write: the cost of that switch
        was most of a relay's CPU per chunk (docs/decisions.md D51). ``sink`` must not
        block or raise; :meth:`hold` pauses the reading when its side cannot take more.
        Raises what ends the answer early (ReadTimeout, Disconnected, BadResponse).
        """
        self._sink = sink
        self.flush()
        self._resume()  # reading may have paused at the high-water mark before the pipe
        try:
            while not self.done:
                await self._wait()
        finally:
            self._sink = None
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Give what a read brought to the ``pipe`` sink (the connection calls this)."""
        sink = self._sink
        if sink is not None and self._chunks:
            data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            sink(data)

    def hold(self, paused: bool) -> None:
        """Pause (True) or resume reading the body: the ``pipe`` sink's back-pressure."""
        if paused and not self._paused and self._conn is not None and not self.done:
            self._paused = True
            self._conn.pause_reading()
        elif not paused:
            self._resume()

    def close(self) -> None:
        """Done with the answer: an unfinished one aborts its connection."""
        self._stop_timer()
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if not self.done:
            self.done = True
            self._error = Disconnected("the response was closed before its end")
            conn.response = None
            conn.abort()
            conn.pool._forget(conn)

    async def __aenter__(self) -> WireResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- fed by the connection -----------------------------------------------------------

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def headers_complete(self) -> None:
        self._started = True
        self._wake()

    def body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._sink is not None:
            return  # flush() hands it on at the end of this read; the sink holds reading
        if self._whole and self._buffered > self._limit:
            self._too_large()
            return
        if (
            self._buffered > _HIGH_WATER
            and not self._paused
            and not self._whole
            and self._conn is not None
        ):
            self._paused = True
            self._conn.pause_reading()
        self._wake()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self.last_read = time.monotonic()  # the pause was ours, not the server's silence
            if self._conn is not None:
                self._conn.resume_reading()

    def message_complete(self, *, keep_alive: bool) -> None:
        self.flush()  # the last body bytes go before the end is known
        self.done = True
        self._stop_timer()
        conn = self._conn
        self._conn = None
        if self._paused and conn is not None:
            self._paused = False
            conn.resume_reading()
        if conn is not None:
            conn.finished(keep_alive=keep_alive)
        self._wake()

    def _too_large(self) -> None:
        """A whole-body read past its limit: the answer fails and its connection is cut."""
        conn = self._conn
        self._chunks.clear()
        self._buffered = 0
        self.fail(
            BadResponse(f"the server's answer is over {self._limit} bytes, too big to read whole")
        )
        if conn is not None:
            conn.abort()

    def fail(self, error: BaseException) -> None:
        if self.done:
            return
        self.done = True
        self._error = error
        self._stop_timer()
        self._conn = None
        self._wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.done:
            return
        if self._started and exc is None and self._until_close():
            # No length and not chunked: the body ends where the connection does.
            self.message_complete(keep_alive=False)
            return
        where = "in the middle of the answer" if self._started else "before answering"
        self.fail(Disconnected(f"the server closed the connection {where}: {exc or 'EOF'}"))

    def _until_close(self) -> bool:
        headers = self.headers
        return "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", ""
        )

    def _check_idle(self) -> None:
        self._timer = None
        if self.done or self._timeout is None:
            return
        if self._paused:
            self.last_read = time.monotonic()  # we stopped reading; the server is not idle
        idle = time.monotonic() - self.last_read
        if idle < self._timeout:
            self._timer = asyncio.get_running_loop().call_later(
                self._timeout - idle, self._check_idle
            )
            return
        conn = self._conn
        error = ReadTimeout(f"the server sent nothing for {self._timeout:g} s")
        self.fail(error)
        if conn is not None:
            conn.timed_out(error)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def wait_headers(self) -> None:
        while not self._started and not self.done:
            await self._wait()
        if not self._started:
            assert self._error is not None
            raise self._error
