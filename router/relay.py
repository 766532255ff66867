"""Passing an agent's answer on to the /v1 client (router/app.py calls these).

``stream`` forwards each chunk as it arrives (what has arrived in one piece, a lone
chunk at once, docs/decisions.md D45) and cancels the upstream when the client leaves;
``WholeReader`` reads an answer whole before its head goes out, so a failure is still
an error answer; ``tee`` lets a usage sniffer see the chunks it does not change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from protocol.errors import ReadTimeout, WireError
from protocol.wire import WireResponse
from router import errors
from router.sse import UsageSniffer

__all__ = ["ClientGone", "Receive", "Send", "WholeReader", "stream", "tee"]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The client went away (or the upstream broke off mid-stream): end the answer."""


@dataclass(slots=True)
class WholeReader:
    """Reads an answer whole before its head goes to the client: a failure then is still
    an error answer (504 for the read timeout, 502 otherwise), never an unhandled 500."""

    response: WireResponse
    name: str
    node_id: str
    timeout: float

    async def read(self) -> bytes:
        try:
            return await self.response.read()
        except ReadTimeout as exc:
            raise errors.upstream_timeout(self.name, self.node_id, self.timeout) from exc
        except WireError as exc:
            raise errors.upstream_unavailable(
                f"Node '{self.node_id}' broke off its answer: {exc}"
            ) from exc

    async def small(self) -> bytes | None:
        """The whole body of a small answer (an engine's 503), None when it is not small."""
        length = self.response.content_length
        if length is None or length > 65536:
            return None
        return await self.read()


def tee(sniffer: UsageSniffer) -> Callable[[bytes], bytes]:
    def feed(chunk: bytes) -> bytes:
        sniffer.feed(chunk)
        return chunk

    return feed


async def stream(
    response: WireResponse,
    receive: Receive,
    send: Send,
    feed: Callable[[bytes], bytes],
    close: Callable[[], bytes] | None,
    finished: Callable[[], bool] | None = None,
) -> None:
    """Forward each chunk as it arrives; a client that goes away cancels the upstream.

    ``feed`` sees every chunk and returns what to forward now (the SSE filter may
    hold back an incomplete event, never more); ``close`` returns what it held.
    """

    # What came with the headers goes out right behind ours, before any task switch:
    # the client then gets both in one read instead of waking twice (measured on the
    # paced streams of bench/router.py).
    first = response.take_buffered()
    if first:
        out = feed(first)
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})

    async def pump() -> None:
        async for chunk in response.iter_chunks():
            out = feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        tail = close() if close is not None else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    pump_task = asyncio.create_task(pump())
    watch_task = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if pump_task in done:
            exc = pump_task.exception()
            if exc is not None and not isinstance(exc, WireError):
                raise exc
            if isinstance(exc, WireError):
                # The upstream aborted mid-stream: end ours the same way.
                raise ClientGone from exc
        elif response.at_eof() or (finished is not None and finished()):
            # The client closed right after the last event it needed ("[DONE]"): the
            # answer was delivered, so it is a 200 with its usage, not a 499.
            response.close()
        else:
            response.close()  # the client left: drop the upstream request now
            raise ClientGone
    finally:
        for task in (pump_task, watch_task):
            task.cancel()
        await asyncio.gather(pump_task, watch_task, return_exceptions=True)
