"""The web server's HTTP protocol: uvicorn's httptools protocol plus the listener limits.

uvicorn's httptools protocol bounds neither the size nor the number of header lines
(httptools buffers an unterminated header whole), has no deadline for a request head
or body, and no cap on connections (``--limit-concurrency`` answers 503 to every
*request*, on old connections too, once that many connections are open, so a few
hundred idle sockets would turn away the operator's own requests). This subclass
applies the rules of ``protocol.http_limits`` (docs/operator-guide.md, "Limits") to
every connection; select it with
``uvicorn --http mirbad_site.http_limits:LimitedHttpToolsProtocol``.

The limits come from ``MIRBAD_HTTP_*`` (``MasterConfig.http_limits``, parsed once at
start by the settings); a subclass may set ``limits`` instead (the tests do).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from protocol.http_limits import HeadGuard, HttpLimits, Refused, answer_and_close

__all__ = ["LimitedHttpToolsProtocol"]

_configured: HttpLimits | None = None


def _settings_limits() -> HttpLimits:
    global _configured
    if _configured is None:
        # Imported late: uvicorn imports this class before the app, and so before the
        # settings are configured; the first connection comes after both.
        from django.conf import settings

        _configured = settings.MIRBAD.http_limits
    return _configured


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with head, deadline and connection limits."""

    limits: ClassVar[HttpLimits | None] = None  # None: the MIRBAD_HTTP_* settings

    _guard: HeadGuard | None = None
    _refused = False  # over the connection cap: never one of the server's connections
    _closing = False  # a limit was broken: nothing more is read

    # uvicorn's own override narrows BaseTransport to Transport the same way (and ignores it too).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # see above
        limits = self.limits or _settings_limits()
        # server_state.connections is this listener's open HTTP and websocket connections.
        if len(self.connections) >= limits.max_connections:
            self._refused = True
            answer_and_close(transport, 503, "the listener has too many connections")
            return
        super().connection_made(transport)
        self._guard = HeadGuard(limits, transport, self._refuse)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return  # never was one of the server's connections
        if self._guard is not None:
            self._guard.close()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's own data_received, with the guard's refusals answered before its
        # catch-all 400 for parser errors.
        if self._refused or self._closing:
            return
        guard = self._guard
        assert guard is not None
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
            guard.after_feed(len(data))
        except Refused as exc:
            self._refuse(exc.status, exc.message)
        except httptools.HttpParserUpgrade:
            guard.close()  # the websocket protocol takes the connection over
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if guard.refusal is not None:
                self._refuse(guard.refusal.status, guard.refusal.message)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)

    # -- parser callbacks: the guard first, then uvicorn ----------------------------

    def on_message_begin(self) -> None:
        assert self._guard is not None
        self._guard.message_begin()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        assert self._guard is not None
        self._guard.url(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._guard is not None
        self._guard.header(name, value)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        assert self._guard is not None
        self._guard.headers_done()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        assert self._guard is not None
        self._guard.message_done()
        super().on_message_complete()

    # -- refusing ---------------------------------------------------------------------

    def _answering(self) -> bool:
        """Whether an answer is being written (a refusal must not land inside it)."""
        cycle = self.cycle
        return cycle is not None and cycle.response_started and not cycle.response_complete

    def _stop_cycle(self) -> None:
        """The request in progress ends here: the app's receive() sees a disconnect
        and its send() writes nothing more."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()

    def _refuse(self, status: int | None, message: str) -> None:
        """Answer ``status`` (unless an answer is being written) and close."""
        if self.transport.is_closing() or self._closing:
            return
        self._closing = True
        self.logger.debug("Refused or closed a connection: %s", message)
        answering = self._answering()
        self._stop_cycle()
        if status is not None and not answering:
            answer_and_close(self.transport, status, message)
        else:
            self.transport.close()
