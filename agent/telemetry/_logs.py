"""The logs the console reads: the agent's own and each engine's, the last 2,000 lines of
each kept in memory (docs/decisions.md D62).

- :class:`LogRing` holds one log's last lines, each with a sequence number that only
  grows, so a reader asks for "the lines after N" and long-polls for the next one.
  Appends come from any thread (logging records are emitted where they happen).
- :class:`RingHandler` feeds the agent's own records (the ``mirbad.agent`` loggers,
  formatted as on stderr) into :data:`AGENT_LOG`; ``agent._run.configure_logging``
  installs it.
- :class:`FileTail` follows an engine's log file: the engine writes it directly
  (opened O_APPEND), and each poll reads the bytes added since the last one, then caps
  the file (``cap``: copy-truncate, protocol/logcap.py). The bytes the engine wrote
  between that read and the cut are read from the copy, ``<name>.1``, so a cap loses
  no line. A file that shrank otherwise (capped by someone else) is read again from
  its start; a file with another inode was replaced and is read from its start too.
- :class:`LogBook` is what the HTTP handlers use: the list of logs, and ``read``,
  which checks the query parameters and answers ``{"name", "lines", "next"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent._errors import InvalidRequest, NotFound
from protocol.logcap import Capped

__all__ = [
    "AGENT_LOG",
    "AGENT_LOG_NAME",
    "FileTail",
    "LogBook",
    "LogRing",
    "RingHandler",
    "install_agent_log",
]

log = logging.getLogger("mirbad.agent.logs")

AGENT_LOG_NAME = "agent"
RING_LINES = 2000
DEFAULT_LIMIT = 200
MAX_WAIT_SECONDS = 25
MAX_SEQ = 2**53  # a JSON number every client reads exactly
# One line of a log is at most this long in the ring (a runaway line is cut, marked).
MAX_LINE_CHARS = 4096
# A poll reads at most this much of a file; an engine that wrote more since the last
# poll has the rest skipped, with a line saying so (only the last 2,000 lines stay anyway).
MAX_READ_BYTES = 4 * 1024 * 1024
# The first read of a file starts this far before its end.
FIRST_READ_BYTES = 1024 * 1024
_INTEGER_RE = re.compile(r"[0-9]{1,16}")


def _clip(text: str) -> str:
    if len(text) <= MAX_LINE_CHARS:
        return text
    return text[:MAX_LINE_CHARS] + f" [... {len(text) - MAX_LINE_CHARS} more characters]"


class LogRing:
    """One log's last ``size`` lines, numbered from 1 up; safe to append from any thread."""

    def __init__(self, size: int = RING_LINES) -> None:
        self._lines: deque[tuple[int, str]] = deque(maxlen=size)
        self._seq = 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest line (0 before the first)."""
        return self._seq

    def append(self, text: str) -> None:
        self.extend([text])

    def extend(self, texts: list[str]) -> None:
        """Add lines (each cut to MAX_LINE_CHARS) and wake the long-polls waiting for them."""
        if not texts:
            return
        with self._lock:
            for text in texts:
                self._seq += 1
                self._lines.append((self._seq, _clip(text)))
            waiters, self._waiters = self._waiters, []
        self._wake(waiters)

    @staticmethod
    def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future)

    def tail(self, limit: int) -> list[dict[str, Any]]:
        """The last ``limit`` lines."""
        with self._lock:
            chosen = list(self._lines)[-limit:] if limit > 0 else []
        return [{"seq": seq, "text": text} for seq, text in chosen]

    def after(self, seq: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` lines after ``seq``, oldest first.

        A ``seq`` beyond the newest line comes from an earlier agent (the numbers started
        over when it restarted): the answer is the last ``limit`` lines, so the reader
        carries on instead of waiting for a number this log may never reach.
        """
        if seq > self._seq:
            return self.tail(limit)
        with self._lock:
            chosen = [(s, t) for s, t in self._lines if s > seq][:limit]
        return [{"seq": s, "text": t} for s, t in chosen]

    async def wait_after(self, seq: int, seconds: float) -> None:
        """Return once a line after ``seq`` exists or ``seconds`` passed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._seq > seq:
                return
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(future, seconds)
        except TimeoutError:
            pass
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove((loop, future))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# The agent's own log: one per process, like its loggers.
AGENT_LOG = LogRing()


class RingHandler(logging.Handler):
    """A logging handler that keeps each formatted record's lines in a :class:`LogRing`."""

    def __init__(self, ring: LogRing) -> None:
        super().__init__()
        self.ring = ring

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # A traceback is several lines; each is a line of the log, as on stderr.
            self.ring.extend(self.format(record).splitlines() or [""])
        except Exception:
            self.handleError(record)


def install_agent_log(formatter: logging.Formatter | None = None) -> RingHandler:
    """Feed the ``mirbad.agent`` loggers into :data:`AGENT_LOG` (once per process)."""
    logger = logging.getLogger("mirbad.agent")
    for handler in logger.handlers:
        if isinstance(handler, RingHandler) and handler.ring is AGENT_LOG:
            return handler
    handler = RingHandler(AGENT_LOG)
    if formatter is not None:
        handler.setFormatter(formatter)
    logger.addHandler(handler)
    return handler


class FileTail:
    """Follows one file an engine appends to, feeding its lines into ``ring``.

    ``cap`` runs after each read (``agent.engines.cap_log``): when it truncated the file,
    what was written since the read comes from the copy, and the next read starts at the
    file's new beginning. Not thread-safe: one poll at a time.
    """

    def __init__(
        self, path: Path, ring: LogRing, *, cap: Callable[[Path], Capped | None] | None = None
    ) -> None:
        self.path = path
        self.ring = ring
        self._cap = cap
        self._offset: int | None = None  # None: not read yet
        self._inode: int | None = None
        self._partial = b""

    def poll(self) -> None:
        """Read what was added since the last poll (blocking; run it in a thread)."""
        try:
            with open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                lines = self._read(handle, stat.st_size, stat.st_ino)
        except FileNotFoundError:
            return  # not started yet, or deleted with its instance
        except OSError as exc:
            log.warning("Cannot read the engine log %s: %s", self.path, exc)
            return
        self.ring.extend(lines)
        capped = self._cap(self.path) if self._cap is not None else None
        if capped is not None:
            self.ring.extend(self._after_cap(capped))

    def _after_cap(self, capped: Capped) -> list[str]:
        """The lines written between the last read and the cut, from the copy."""
        offset = self._offset or 0
        self._offset = 0  # the file starts again; a line cut in two goes on in it
        if offset >= capped.end:
            return []
        first = max(offset, capped.start, capped.end - MAX_READ_BYTES)
        data = b""
        if capped.rotated is not None:
            try:
                with open(capped.rotated, "rb") as copy:
                    copy.seek(first - capped.start)
                    data = copy.read(capped.end - first)
            except OSError as exc:
                log.warning("Cannot read the engine log copy %s: %s", capped.rotated, exc)
        if not data:
            return [self._dropped(capped.end - offset, capped)]
        lines = [self._dropped(first - offset, capped)] if first > offset else []
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()
        lines.extend(c.decode("utf-8", "replace").rstrip("\r") for c in chunks)
        if first + len(data) < capped.end:
            lines.append(self._dropped(capped.end - first - len(data), capped))
        return lines

    def _dropped(self, count: int, capped: Capped) -> str:
        self._partial = b""
        why = capped.reason or "more than a poll reads, or no copy is kept"
        return f"[agent: {count} bytes of this log were skipped when it was capped: {why}]"

    def _read(self, handle: Any, size: int, inode: int) -> list[str]:
        lines: list[str] = []
        if self._offset is None:
            # The first read: the last lines only, from a line start.
            start = max(0, size - FIRST_READ_BYTES)
            self._offset, drop_first = start, start > 0
        else:
            drop_first = False
            if inode != self._inode or size < self._offset:
                # Rotated at a restart (another inode) or capped (shorter): from the start.
                self._offset, self._partial = 0, b""
        self._inode = inode
        if size - self._offset > MAX_READ_BYTES:
            skipped = size - MAX_READ_BYTES - self._offset
            lines.append(f"[agent: {skipped} bytes of this log were skipped]")
            self._offset, self._partial, drop_first = size - MAX_READ_BYTES, b"", True
        handle.seek(self._offset)
        data = handle.read(size - self._offset)
        self._offset += len(data)
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()
        if len(self._partial) > MAX_LINE_CHARS * 4:  # a line without an end: cut it here
            chunks.append(self._partial)
            self._partial = b""
        if drop_first and chunks:
            chunks = chunks[1:]
        lines.extend(c.decode("utf-8", "replace").rstrip("\r") for c in chunks)
        return lines


def _poll_all(tails: list[FileTail]) -> None:
    for tail in tails:
        tail.poll()


def _bounded(query: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    """The integer query parameter ``name`` within low..high, None when absent."""
    raw = query.get(name)
    if raw is None:
        return None
    value = int(raw) if _INTEGER_RE.fullmatch(raw) else None
    if value is None or not low <= value <= high:
        raise InvalidRequest(
            f"{name} must be a whole number from {low} to {high}, not {raw[:40]!r}",
            details={"field": name},
        )
    return value


class LogBook:
    """The agent's log and one per engine instance the runtime knows, for the console.

    ``instances`` answers ``(instanceId, state)`` of every instance (called on the event
    loop); ``log_path`` where an instance's engine log is. A background task polls the
    engine logs every ``poll_interval`` seconds, in a thread.
    """

    def __init__(
        self,
        *,
        instances: Callable[[], list[tuple[str, str]]],
        log_path: Callable[[str], Path],
        cap: Callable[[Path], Capped | None] | None = None,
        agent_ring: LogRing = AGENT_LOG,
        poll_interval: float = 0.5,
    ) -> None:
        self._instances = instances
        self._log_path = log_path
        self._cap = cap
        self._agent = agent_ring
        self._poll_interval = poll_interval
        self._tails: dict[str, FileTail] = {}
        self._task: asyncio.Task[None] | None = None
        self._poll_lock = asyncio.Lock()
        self._closing = asyncio.Event()

    def listing(self) -> dict[str, Any]:
        """``{"logs": [...]}``: the agent's, then each instance's."""
        logs: list[dict[str, Any]] = [{"name": AGENT_LOG_NAME, "kind": "agent"}]
        for instance_id, state in self._instances():
            logs.append(
                {"name": instance_id, "kind": "engine", "instanceId": instance_id, "state": state}
            )
        return {"logs": logs}

    def _sync(self) -> list[FileTail]:
        """A tail for each instance the runtime knows; forget those it no longer has."""
        known = {instance_id for instance_id, _ in self._instances()}
        for gone in set(self._tails) - known:
            del self._tails[gone]
        for instance_id in known - set(self._tails):
            self._tails[instance_id] = FileTail(
                self._log_path(instance_id), LogRing(), cap=self._cap
            )
        return list(self._tails.values())

    async def poll(self) -> None:
        """Read every engine log once now."""
        async with self._poll_lock:
            tails = self._sync()
            await asyncio.to_thread(_poll_all, tails)

    def _ring(self, name: str) -> LogRing:
        if name == AGENT_LOG_NAME:
            return self._agent
        tail = self._tails.get(name)
        if tail is None:
            raise NotFound(f"no log named {name!r} on this node; GET /agent/v1/logs lists them")
        return tail.ring

    async def read(self, name: str, query: Mapping[str, str]) -> dict[str, Any]:
        """The answer of ``GET /agent/v1/logs/{name}`` (docs/agent-api.md, "Logs")."""
        after = _bounded(query, "after", 0, MAX_SEQ)
        limit = _bounded(query, "limit", 1, RING_LINES) or DEFAULT_LIMIT
        wait = _bounded(query, "wait", 0, MAX_WAIT_SECONDS) or 0
        if name != AGENT_LOG_NAME and name not in self._tails:
            await self.poll()  # an instance launched since the last poll: read it now
        ring = self._ring(name)
        if after is None:
            lines = ring.tail(limit)
        else:
            lines = ring.after(after, limit)
            if not lines and wait and not self._closing.is_set():
                await self._wait(ring, after, wait)
                lines = ring.after(after, limit)
        if lines:
            next_seq = lines[-1]["seq"]
        else:
            next_seq = ring.last_seq if after is None else min(after, ring.last_seq)
        return {"name": name, "lines": lines, "next": next_seq}

    async def _wait(self, ring: LogRing, after: int, wait: int) -> None:
        # A long-poll ends early when the agent stops, so it never holds up the shutdown.
        waiters = [
            asyncio.ensure_future(ring.wait_after(after, wait)),
            asyncio.ensure_future(self._closing.wait()),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:
                log.exception("Polling the engine logs failed")
            await asyncio.sleep(self._poll_interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="log-tails")

    async def close(self) -> None:
        """Stop polling and answer every long-poll at once (the agent is stopping)."""
        self._closing.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
