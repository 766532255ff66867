"""Streaming reverse proxy from ``/agent/v1/proxy/{id}/...`` to an engine on loopback.

Nothing is buffered: the request body is forwarded as it arrives and every response
chunk is written to the client as soon as the engine sends it, which is what makes
token streaming (SSE) work end to end. The client's Authorization is replaced by the
instance's own key, so a caller never needs (or learns) it. One long-lived client
session keeps connections to the engines pooled across requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from agent._errors import ServerBusy, UpstreamUnavailable

__all__ = ["Proxy", "Upstream"]

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
_SMALL_BODY = 1024 * 1024
_CHUNK = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """Where one instance listens and the key it expects."""

    port: int
    key: str
    served_name: str


def _forwardable(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    named = {
        token.strip().lower()
        for value in headers.getall("Connection", [])
        for token in value.split(",")
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in named or lower in drop:
            continue
        out.add(name, value)
    return out


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
        self._session: aiohttp.ClientSession | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        # auto_decompress off: bytes pass through as the engine encoded them, together
        # with its Content-Encoding. No cookie jar: the proxy must not carry state
        # between callers.
        self._session = aiohttp.ClientSession(
            # llama-server (cpp-httplib) drops idle keep-alive connections after 5 s;
            # giving them up after 4 s here avoids reusing one it is just closing.
            connector=aiohttp.TCPConnector(
                limit=max(self._max, 100), limit_per_host=0, keepalive_timeout=4.0
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The aiohttp handler for ``/agent/v1/proxy/{instanceId}/{path}``."""
        instance_id = request.match_info["instanceId"]
        upstream = self._resolve(instance_id)
        if self._in_flight >= self._max:
            raise ServerBusy(
                f"the agent proxy already carries {self._max} requests (ProxyMaxInFlight); retry later"
            )
        self._in_flight += 1
        try:
            return await self._forward(request, upstream)
        finally:
            self._in_flight -= 1

    def _target(self, request: web.Request, upstream: Upstream) -> URL:
        # The raw (still percent-encoded) path is forwarded, so the engine sees exactly
        # what the client sent after the /agent/v1/proxy/{id}/ prefix.
        parts = request.rel_url.raw_path.split("/", 5)
        rest = parts[5] if len(parts) > 5 else ""
        query = request.rel_url.raw_query_string
        text = f"http://127.0.0.1:{upstream.port}/{rest}" + (f"?{query}" if query else "")
        return URL(text, encoded=True)

    async def _forward(self, request: web.Request, upstream: Upstream) -> web.StreamResponse:
        assert self._session is not None, "Proxy.start() was not called"
        headers = _forwardable(request.headers, frozenset({"host", "authorization", "expect"}))
        headers["Authorization"] = f"Bearer {upstream.key}"
        body: AsyncIterator[bytes] | bytes | None = None
        if request.body_exists:
            length = request.content_length
            if length is not None and length <= _SMALL_BODY:
                # Almost every request: one write of headers and body, where a streamed
                # upload costs a chunked write per piece (a third of the agent's CPU).
                body = await request.read()
            else:
                body = self._stream_body(request)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._connect, sock_read=self._idle or None
        )
        try:
            response = await self._session.request(
                request.method,
                self._target(request, upstream),
                headers=headers,
                data=body,
                allow_redirects=False,
                timeout=timeout,
            )
        except TimeoutError:
            raise UpstreamUnavailable(self._idle_message(upstream)) from None
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(
                f"Model '{upstream.served_name}' could not be reached on port {upstream.port}: {exc}"
            ) from None
        try:
            return await self._relay(request, response, upstream)
        finally:
            response.close()

    async def _stream_body(self, request: web.Request) -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_chunked(_CHUNK):
            yield chunk

    def _idle_message(self, upstream: Upstream) -> str:
        return (
            f"Model '{upstream.served_name}' sent no response for {self._idle:g} s; "
            "it may be stalled or overloaded."
        )

    async def _relay(
        self, request: web.Request, response: aiohttp.ClientResponse, upstream: Upstream
    ) -> web.StreamResponse:
        length = response.content_length
        streamed = "text/event-stream" in response.headers.get("Content-Type", "")
        if not streamed and length is not None and length <= _SMALL_BODY:
            # A small whole answer: read it, then send headers and body in one write.
            try:
                body = await response.read()
            except TimeoutError:
                raise UpstreamUnavailable(self._idle_message(upstream)) from None
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                raise UpstreamUnavailable(
                    f"Model '{upstream.served_name}' broke off its answer: {exc}"
                ) from None
            whole = web.Response(status=response.status, reason=response.reason, body=body)
            whole.headers.extend(_forwardable(response.headers, frozenset({"content-length"})))
            return whole
        out = web.StreamResponse(status=response.status, reason=response.reason)
        out.headers.extend(_forwardable(response.headers, frozenset()))
        await out.prepare(request)
        try:
            async for chunk in response.content.iter_any():
                await out.write(chunk)
        except TimeoutError:
            log.warning("%s; aborting the stream", self._idle_message(upstream))
            self._abort(request)
            return out
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            # Either side went away mid-stream. An upstream failure must not look like a
            # complete response, so the client connection is cut rather than ended.
            log.info("Proxy stream to %s ended early: %s", upstream.served_name, exc)
            self._abort(request)
            return out
        except ConnectionResetError:
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
