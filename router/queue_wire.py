"""A lean, pipelined Redis connection for the fair queue's script calls.

Every /v1 request makes two script calls (router.queue: take a slot, free it).
Through redis-py's asyncio client each cost ~225 µs of the web process's CPU
(connection-pool checkout, locks, a task per timeout, about ten turns of the event
loop), which halved the router's throughput at c=64 (docs/performance.md, "Fair
queue"). This module speaks RESP2 on one connection per event loop: a call writes
its command at once, without waiting for earlier answers, and a future per call is
resolved in arrival order as the replies are parsed. A call costs a write, one parse
and one future.

Failures: a connection error, a reply that cannot be parsed, or a call past its
timeout closes the connection and fails every call waiting on it (``QueueWireError``,
an ``OSError``; the queue then fails open), and the next call connects again. A
timed-out call must close the connection: its reply may still come and would be
matched to the next call.

It connects where the queue's redis-py client connects (host and port, or a unix
socket, the database, user and password), read from that client's pool; TLS
(``rediss://``) is not spoken here: ``lean_for`` answers None and the queue keeps
redis-py for those calls.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import RedisError

__all__ = ["LeanRedis", "QueueWireError", "lean_for"]

CONNECT_TIMEOUT = 2.0
MAX_REPLY = 16 * 1024 * 1024  # a reply bigger than this is not one of ours


class QueueWireError(OSError):
    """The connection failed, timed out or answered something unreadable."""


class ScriptError(RedisError):
    """Redis answered an error reply (``-ERR ...``); the queue treats it as any Redis error."""


def lean_for(client: aioredis.Redis, *, timeout: float) -> LeanRedis | None:
    """A lean connection to where ``client`` connects, or None when it cannot speak it."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if pool.connection_class is UnixDomainSocketConnection:
        target: tuple[str, int] | str = str(kwargs["path"])
    elif pool.connection_class is Connection:
        target = (str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379)))
    else:  # TLS or a custom class
        return None
    return LeanRedis(
        target=target,
        db=int(kwargs.get("db") or 0),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        timeout=timeout,
    )


def _encode(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            raw = arg
        elif isinstance(arg, str):
            raw = arg.encode()
        else:
            raw = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


class _Incomplete(Exception):
    pass


def _parse(buffer: bytes, at: int) -> tuple[Any, int]:
    """One RESP2 value from ``buffer[at:]``: (value, the offset after it)."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        raise _Incomplete
    kind, line = buffer[at : at + 1], buffer[at + 1 : end]
    after = end + 2
    if kind == b"+":
        return line.decode(), after
    if kind == b"-":
        return ScriptError(line.decode(errors="replace")), after
    if kind == b":":
        return int(line), after
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, after
        if size > MAX_REPLY:
            raise QueueWireError(f"a reply of {size} bytes")
        if len(buffer) < after + size + 2:
            raise _Incomplete
        return buffer[after : after + size].decode(), after + size + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, after
        items = []
        for _ in range(count):
            item, after = _parse(buffer, after)
            items.append(item)
        return items, after
    raise QueueWireError(f"unreadable reply type {kind!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: LeanRedis) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        # Commands of one turn of the event loop leave in one write (at c=64 dozens of
        # requests call in the same turn: one system call instead of dozens).
        self.outgoing: list[bytes] = []

    def queue(self, command: bytes) -> None:
        if not self.outgoing:
            asyncio.get_running_loop().call_soon(self.flush)
        self.outgoing.append(command)

    def flush(self) -> None:
        if self.outgoing and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.outgoing))
        self.outgoing = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: no isinstance check.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer = self.buffer + data if self.buffer else data
        at = 0
        try:
            while at < len(self.buffer):
                value, at = _parse(self.buffer, at)
                if not self.waiting:
                    raise QueueWireError("a reply nobody asked for")
                future = self.waiting.popleft()
                if not future.done():
                    future.set_result(value)
        except _Incomplete:
            pass
        except (QueueWireError, ValueError) as exc:
            self.fail(QueueWireError(f"Redis answered badly: {exc}"))
            return
        self.buffer = self.buffer[at:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(QueueWireError(f"the connection to Redis closed: {exc!r}"))

    def fail(self, error: Exception) -> None:
        if self.owner._protocol is self:
            self.owner._protocol = None
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


class LeanRedis:
    """One pipelined RESP2 connection (per event loop) for EVALSHA calls."""

    def __init__(
        self,
        *,
        target: tuple[str, int] | str,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 1.0,
    ) -> None:
        self._target = target
        self._db = db
        self._username = username
        self._password = password
        self._timeout = timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._shas: dict[str, str] = {}

    async def evalsha(self, script: str, *args: Any) -> Any:
        """Run ``script`` (loaded once per connection) with ``args`` as ARGV (no KEYS)."""
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA-1
        answer = await self._call("EVALSHA", sha, 0, *args)
        if isinstance(answer, ScriptError) and answer.args[0].startswith("NOSCRIPT"):
            loaded = await self._call("SCRIPT", "LOAD", script)
            if isinstance(loaded, ScriptError):
                raise loaded
            answer = await self._call("EVALSHA", sha, 0, *args)
        if isinstance(answer, ScriptError):
            raise answer
        return answer

    async def _call(self, *args: Any) -> Any:
        protocol = self._protocol or await self._connect()
        return await self._send(protocol, args)

    async def _send(self, protocol: _Protocol, args: tuple[Any, ...]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if protocol.transport is None or protocol.transport.is_closing():
            raise QueueWireError("the connection to Redis is closed")
        protocol.waiting.append(future)
        protocol.queue(_encode(args))
        timer = asyncio.get_running_loop().call_later(self._timeout, self._expire, protocol, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, protocol: _Protocol, future: asyncio.Future[Any]) -> None:
        if not future.done():
            # Its reply may still come and would answer the next call: start over.
            protocol.fail(QueueWireError(f"Redis did not answer within {self._timeout:g} s"))

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            if isinstance(self._target, str):
                connect = loop.create_unix_connection(lambda: _Protocol(self), self._target)
            else:
                host, port = self._target
                connect = loop.create_connection(lambda: _Protocol(self), host, port)
            _, protocol = await asyncio.wait_for(connect, CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise QueueWireError(f"cannot connect to Redis: {exc!r}") from exc
        hello: list[tuple[Any, ...]] = []
        if self._password:
            hello.append(
                ("AUTH", self._username, self._password) if self._username
                else ("AUTH", self._password)
            )  # fmt: skip
        if self._db:
            hello.append(("SELECT", self._db))
        # Written back to back before any call can use the connection: a call may not
        # slip in between AUTH and SELECT and run in the wrong database.
        answers = await asyncio.gather(
            *(self._send(protocol, command) for command in hello), return_exceptions=True
        )
        for command, answer in zip(hello, answers, strict=True):
            if isinstance(answer, BaseException):
                protocol.fail(QueueWireError(f"Redis refused {command[0]}: {answer}"))
                raise QueueWireError(f"Redis refused {command[0]}: {answer}")
        self._protocol = protocol
        return protocol

    def close(self) -> None:
        if self._protocol is not None:
            self._protocol.fail(QueueWireError("closed"))
