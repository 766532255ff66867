"""In-process event bus feeding the ``/agent/v1/events`` streams.

Every published event gets the next number of one per-boot sequence, so the master can
tell from ``id:`` lines whether it saw events in order. Each subscriber has a bounded
queue: a subscriber that falls that far behind is closed rather than silently skipped,
because a master that missed events must reconnect and take a full ``/status``
snapshot, and a closed stream is what tells it to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "EventBus", "Subscription"]

log = logging.getLogger("mirbad.agent.events")


@dataclass(frozen=True, kw_only=True)
class Event:
    """One event as it goes out on the stream."""

    seq: int
    type: str
    data: dict[str, Any]


_CLOSED = object()


class Subscription:
    """One subscriber's queue; iterate it to receive events, or use :meth:`get`."""

    def __init__(self, *, bus: EventBus, max_queue: int) -> None:
        self._bus = bus
        self._queue: asyncio.Queue[Event | object] = asyncio.Queue(maxsize=max_queue + 1)
        self._max = max_queue
        self.closed = False
        self.overflowed = False

    def _offer(self, event: Event) -> None:
        if self.closed:
            return
        if self._queue.qsize() >= self._max:
            self.overflowed = True
            log.warning("An event subscriber fell %d events behind; closing its stream", self._max)
            self.close()
            return
        self._queue.put_nowait(event)

    def close(self) -> None:
        """End the stream; a pending :meth:`get` returns None."""
        if self.closed:
            return
        self.closed = True
        self._bus._discard(self)
        # The queue has one slot held back for this marker, so this never blocks.
        self._queue.put_nowait(_CLOSED)

    async def get(self) -> Event | None:
        """The next event; None once the subscription is closed."""
        item = await self._queue.get()
        if item is _CLOSED:
            self._queue.put_nowait(_CLOSED)
            return None
        assert isinstance(item, Event)
        return item

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            event = await self.get()
            if event is None:
                return
            yield event

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    """Fan-out of events to subscribers, with one sequence number per agent boot."""

    def __init__(self, *, max_queue: int = 1000) -> None:
        self._counter = itertools.count(1)
        self._subscribers: set[Subscription] = set()
        self._max_queue = max_queue

    def next_seq(self) -> int:
        """Take a sequence number for an event only one stream sees (hello, heartbeat)."""
        return next(self._counter)

    def publish(self, event_type: str, data: dict[str, Any]) -> Event:
        """Send an event to every current subscriber without waiting for any of them."""
        event = Event(seq=self.next_seq(), type=event_type, data=data)
        for sub in list(self._subscribers):
            sub._offer(event)
        return event

    def subscribe(self) -> Subscription:
        """A new subscription; close it (or use it as a context manager) when done."""
        sub = Subscription(bus=self, max_queue=self._max_queue)
        self._subscribers.add(sub)
        return sub

    def _discard(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        """Close every subscription (agent shutdown)."""
        for sub in list(self._subscribers):
            sub.close()
