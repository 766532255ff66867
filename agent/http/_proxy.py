"""Streaming reverse proxy from ``/agent/v1/proxy/{id}/...`` to an engine on loopback.

Nothing is buffered: the request body is forwarded as it arrives and every response
chunk is written to the client as soon as the engine sends it, which is what makes
token streaming (SSE) work end to end. The client's Authorization is replaced by the
instance's own key, so a caller never needs (or learns) it. The lean wire client
(``protocol.wire``, D29) keeps connections to the engines pooled across requests.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from aiohttp import web

from agent._errors import ReadTimeout, ServerBusy, UpstreamUnavailable, WireError
from protocol.wire import WirePool, WireResponse

__all__ = [
    "SMALL_BODY",
    "Proxy",
    "RelayMode",
    "StreamBroken",
    "Upstream",
    "engine_slots",
    "relay_mode",
    "request_headers",
    "response_headers",
]

log = logging.getLogger("mirbad.agent.proxy")

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# The wire client frames the request itself (Host, Content-Length or chunked).
_REQUEST_DROP = frozenset({"host", "authorization", "expect", "content-length"})
SMALL_BODY = 1024 * 1024  # up to this, request and answer bodies go in one write
_CHUNK = 64 * 1024
_SLOT_FLAGS = ("-np", "--parallel")
LLAMA_AUTO_SLOTS = 4  # llama-server's slots without -np (or with -np -1: "auto")


RelayMode = Literal["empty", "whole", "stream"]


def relay_mode(method: str, response: WireResponse) -> RelayMode:
    """How an engine's answer is passed on; the one rule of both proxy stacks (D32).

    ``empty``: no body (HEAD, 204, 304). ``whole``: a small answer that is not an event
    stream, read whole and written with its head in one write. ``stream``: everything
    else, the first buffered chunk with the head, then what has arrived at each read
    (:meth:`Proxy.rest_of_stream`), never holding back a chunk that is alone.
    """
    if method == "HEAD" or response.status in (204, 304):
        return "empty"
    length = response.content_length
    streamed = "text/event-stream" in (response.header("content-type") or "")
    if not streamed and length is not None and length <= SMALL_BODY:
        return "whole"
    return "stream"


class StreamBroken(Exception):
    """The engine stopped or went silent mid-stream (already logged): the relay must cut
    the client's connection, so a broken answer never looks complete."""


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """Where one instance listens and the key it expects."""

    port: int
    key: str
    served_name: str
    # 127.0.0.1 for a process or a published container port; a container's name on the
    # agent's Docker network otherwise.
    host: str = "127.0.0.1"
    # The requests the engine serves at once (llama-server's -np); the proxy keeps no
    # more idle connections to it than that. None: the pool's own limit.
    slots: int | None = None


@functools.lru_cache(maxsize=256)
def engine_slots(args: Sequence[str]) -> int:
    """The parallel slots a llama-server argv asks for: the last ``-np``/``--parallel``
    (llama-server takes the last of a repeated flag), llama-server's auto value when
    there is none. ``args`` must be hashable (a launch spec's tuple)."""
    value: str | None = None
    for index, arg in enumerate(args):
        if arg in _SLOT_FLAGS and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(("-np=", "--parallel=")):
            value = arg.partition("=")[2]
    try:
        slots = int(value) if value is not None else -1
    except ValueError:
        slots = -1  # llama-server refuses to start on it; nothing is proxied anyway
    return slots if slots >= 1 else LLAMA_AUTO_SLOTS


def _connection_tokens(values: list[str]) -> frozenset[str]:
    return frozenset(token.strip().lower() for value in values for token in value.split(","))


def request_headers(headers: Iterable[tuple[str, str]], key: str) -> list[tuple[str, str]]:
    """The client's headers as the engine gets them: hop-by-hop ones dropped, our key in."""
    pairs = list(headers)
    named = _connection_tokens([v for k, v in pairs if k.lower() == "connection"])
    out = [
        (name, value)
        for name, value in pairs
        if (lower := name.lower()) not in _HOP_BY_HOP
        and lower not in _REQUEST_DROP
        and lower not in named
    ]
    out.append(("Authorization", f"Bearer {key}"))
    return out


def response_headers(response: WireResponse, drop: frozenset[str]) -> list[tuple[str, str]]:
    """The engine's headers as the client gets them (hop-by-hop ones and ``drop`` out)."""
    raw = response.raw_headers
    named = _connection_tokens([v.decode("latin-1") for k, v in raw if k.lower() == b"connection"])
    out: list[tuple[str, str]] = []
    for name_b, value_b in raw:
        name = name_b.decode("latin-1")
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in named or lower in drop:
            continue
        out.append((name, value_b.decode("latin-1")))
    return out


def split_target(raw_path: str) -> tuple[str, str]:
    """``/agent/v1/proxy/{id}/{rest}?{query}`` as (id, ``/{rest}?{query}``).

    The raw (still percent-encoded) path is forwarded, so the engine sees exactly what
    the client sent after the prefix.
    """
    path, sep, query = raw_path.partition("?")
    parts = path.split("/", 5)
    instance_id = parts[4] if len(parts) > 4 else ""
    rest = parts[5] if len(parts) > 5 else ""
    return instance_id, f"/{rest}?{query}" if sep and query else f"/{rest}"


class _WithFirstChunk(web.StreamResponse):
    """A streamed answer whose headers wait for its first write (aiohttp's Response does
    the same); used only when that first chunk is already here, so nothing is delayed."""

    _send_headers_immediately = False


class Proxy:
    """Forwards requests to Ready instances with an in-flight limit and an idle timeout."""

    def __init__(
        self,
        *,
        resolve: Callable[[str], Upstream],
        max_in_flight: int,
        idle_timeout_seconds: float,
        connect_timeout_seconds: float = 10.0,
    ) -> None:
        self._resolve = resolve
        self._max = max_in_flight
        self._idle = idle_timeout_seconds
        self._connect = connect_timeout_seconds
        self._in_flight = 0
        self._pool: WirePool | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        # llama-server (cpp-httplib) drops idle keep-alive connections after 5 s;
        # giving them up after 4 s here avoids reusing one it is just closing (and the
        # wire client sends a request again that met such a close unanswered). Each
        # engine keeps at most its slots idle (Upstream.slots, from -np): one for every
        # request it can start at once, not one per request of the last burst. The wire
        # client carries no state between callers (no cookies, no auth of its own), and
        # bytes pass through as the engine encoded them, with its Content-Encoding.
        self._pool = WirePool(
            keepalive_seconds=4.0,
            connect_timeout=self._connect,
            max_idle_per_host=max(self._max, 100),
        )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def admit(self, instance_id: str) -> Upstream:
        """The instance's upstream, counted in flight until ``release()``; or the ApiError
        to answer (not Ready, or the proxy at its limit)."""
        upstream = self._resolve(instance_id)
        if self._in_flight >= self._max:
            raise ServerBusy(
                f"the agent proxy already carries {self._max} requests (ProxyMaxInFlight); retry later"
            )
        self._in_flight += 1
        return upstream

    def release(self) -> None:
        self._in_flight -= 1

    async def open(
        self,
        upstream: Upstream,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: AsyncIterator[bytes] | bytes | None,
    ) -> WireResponse:
        """Send one request to the engine; its headers are in when this returns."""
        assert self._pool is not None, "Proxy.start() was not called"
        try:
            return await self._pool.request(
                method,
                upstream.host,
                upstream.port,
                target,
                headers=headers,
                body=body,
                read_timeout=self._idle or None,
                max_idle=upstream.slots,
            )
        except ReadTimeout:
            raise UpstreamUnavailable(self.idle_message(upstream)) from None
        except (WireError, ValueError) as exc:
            raise UpstreamUnavailable(
                f"Model '{upstream.served_name}' could not be reached on port {upstream.port}: {exc}"
            ) from None

    async def read_whole(self, response: WireResponse, upstream: Upstream) -> bytes:
        """The rest of a small answer, engine failures as UpstreamUnavailable."""
        try:
            return await response.read()
        except ReadTimeout:
            raise UpstreamUnavailable(self.idle_message(upstream)) from None
        except WireError as exc:
            raise UpstreamUnavailable(
                f"Model '{upstream.served_name}' broke off its answer: {exc}"
            ) from None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The aiohttp handler for ``/agent/v1/proxy/{instanceId}/{path}``."""
        upstream = self.admit(request.match_info["instanceId"])
        try:
            return await self._forward(request, upstream)
        finally:
            self.release()

    @staticmethod
    def _target(request: web.Request) -> str:
        return split_target(request.raw_path)[1]

    async def _forward(self, request: web.Request, upstream: Upstream) -> web.StreamResponse:
        headers = request_headers(request.headers.items(), upstream.key)
        body: AsyncIterator[bytes] | bytes | None = None
        if request.body_exists:
            length = request.content_length
            if length is not None and length <= SMALL_BODY:
                # Almost every request: one write of headers and body, where a streamed
                # upload costs a chunked write per piece (a third of the agent's CPU).
                body = await request.read()
            else:
                body = self._stream_body(request)
        response = await self.open(upstream, request.method, self._target(request), headers, body)
        try:
            return await self._relay(request, response, upstream)
        finally:
            response.close()

    async def _stream_body(self, request: web.Request) -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_chunked(_CHUNK):
            yield chunk

    def idle_message(self, upstream: Upstream) -> str:
        return (
            f"Model '{upstream.served_name}' sent no response for {self._idle:g} s; "
            "it may be stalled or overloaded."
        )

    @contextlib.contextmanager
    def _stream_failures(self, upstream: Upstream) -> Iterator[None]:
        """An engine failing mid-stream, logged once and raised as StreamBroken."""
        try:
            yield
        except ReadTimeout:
            log.warning("%s; aborting the stream", self.idle_message(upstream))
            raise StreamBroken from None
        except WireError as exc:
            log.info("Proxy stream to %s ended early: %s", upstream.served_name, exc)
            raise StreamBroken from None

    async def rest_of_stream(
        self, response: WireResponse, upstream: Upstream
    ) -> AsyncIterator[bytes]:
        """The body after its buffered first chunk, each read as one piece (what is
        waiting goes on together); StreamBroken when the engine fails mid-stream.
        aiohttp's route, whose writes are coroutines; the lean front pipes instead."""
        with self._stream_failures(upstream):
            async for chunk in response.iter_chunks():
                if chunk:
                    yield chunk

    async def pipe_stream(
        self, response: WireResponse, upstream: Upstream, sink: Callable[[bytes], None]
    ) -> None:
        """The body after its buffered first chunk, handed to ``sink`` from the engine
        connection's read callback (:meth:`WireResponse.pipe`, D51); StreamBroken when
        the engine fails mid-stream. The lean front's relay."""
        with self._stream_failures(upstream):
            await response.pipe(sink)

    async def _relay(
        self, request: web.Request, response: WireResponse, upstream: Upstream
    ) -> web.StreamResponse:
        # aiohttp itself leaves out the body of a HEAD, 204 or 304 answer, so "empty" is
        # relayed like a stream (of nothing).
        if relay_mode(request.method, response) == "whole":
            body = await self.read_whole(response, upstream)
            whole = web.Response(status=response.status, body=body)
            whole.headers.extend(response_headers(response, frozenset({"content-length"})))
            return whole
        # An engine that sent its first chunk with its headers (llama-server does) gets
        # both forwarded in one write: the router then wakes once, not twice.
        first = response.take_buffered()
        out = (_WithFirstChunk if first else web.StreamResponse)(status=response.status)
        out.headers.extend(response_headers(response, frozenset()))
        await out.prepare(request)
        try:
            if first:
                await out.write(first)
            async for chunk in self.rest_of_stream(response, upstream):
                await out.write(chunk)
        except StreamBroken:
            self._abort(request)
            return out
        except ConnectionResetError as exc:
            # The client went away mid-stream.
            log.info("Proxy stream to %s ended early: %s", upstream.served_name, exc)
            self._abort(request)
            return out
        await out.write_eof()
        return out

    @staticmethod
    def _abort(request: web.Request) -> None:
        transport = request.transport
        if transport is not None:
            with contextlib.suppress(Exception):
                transport.abort()
