"""The monitor's Redis writes, many workers' in one transaction (a group commit).

Each sample, event and state change of a node writes its record (and with a sample its
history point and stall flags). Written by each worker on its own, a thousand nodes made
hundreds of round trips a second through a pool of 32 connections: under load a worker
waited for a connection while its event stream went unread, and its record aged
towards the 15 s after which a node is shown Offline (docs/performance.md, "A fleet of
a thousand machines"). :class:`GroupWriter` queues what the workers stage and writes
everything queued in one ``MULTI``/``EXEC`` per round trip; each writer still awaits its
own write (its caller announces the change only after it is in Redis), so the order of
a node's writes and announcements is unchanged. :class:`DirectWriter` writes at once,
for a worker made without a monitor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from redis.asyncio.client import Pipeline

from nodes import status_cache

log = logging.getLogger("mirbad.monitor")

Stage = Callable[[Pipeline], None]  # queues more of a node's commands with its record
# Writes per transaction at most: one node's sample is three to five commands, and
# Redis runs a transaction whole before any other client's command.
MAX_BATCH = 256


class Writer(Protocol):
    """Where a monitor worker writes its node's record."""

    async def write(self, status: status_cache.NodeStatus, also: Stage | None = None) -> None:
        """Write the record, and ``also``'s commands in the same transaction; raises
        what the write raised."""


class DirectWriter:
    """Each write on its own (a worker made without a monitor)."""

    async def write(self, status: status_cache.NodeStatus, also: Stage | None = None) -> None:
        if also is None:
            await status_cache.awrite(status)
            return
        async with status_cache.async_client().pipeline(transaction=True) as pipe:
            status_cache.stage_write(status, pipe)
            also(pipe)
            await pipe.execute()


_Queued = tuple[status_cache.NodeStatus, "Stage | None", "asyncio.Future[None]"]


class GroupWriter:
    """Writes from every worker of a loop, queued and written together.

    The first write starts a task that empties the queue, :data:`MAX_BATCH` at a time,
    one transaction each, in the order they came (a node's later record wins), and ends
    when the queue is empty. A failed transaction fails each of its writes with the
    same error (the workers log it and write again with their next change); a record or
    stage that raises fails its own write only. The record is encoded when its batch is
    sent: a worker that changed it meanwhile has its newest written.
    """

    def __init__(self, *, max_batch: int = MAX_BATCH) -> None:
        self.max_batch = max_batch
        self.queue: list[_Queued] = []
        self.task: asyncio.Task[None] | None = None
        self.batches = 0  # transactions sent

    async def write(self, status: status_cache.NodeStatus, also: Stage | None = None) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue.append((status, also, done))
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.drain(), name="status-writer")
        await done

    async def drain(self) -> None:
        """Write what is queued until nothing is (a step a test can call)."""
        while self.queue:
            batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
            await self._one(batch)

    async def _one(self, batch: list[_Queued]) -> None:
        staged: list[asyncio.Future[None]] = []
        try:
            async with status_cache.async_client().pipeline(transaction=True) as pipe:
                for status, also, done in batch:
                    if done.done():  # its worker was stopped meanwhile: nothing to write
                        continue
                    try:
                        # Encoded before it is queued: a record that cannot be leaves
                        # nothing of its node in the transaction.
                        status_cache.stage_write(status, pipe)
                        if also is not None:
                            also(pipe)
                    except Exception as exc:  # one node's odd record, not the others'
                        log.exception("Node %s: staging its write failed", status.get("nodeId"))
                        done.set_exception(exc)
                        continue
                    staged.append(done)
                if staged:
                    await pipe.execute()
                    self.batches += 1
        except BaseException as exc:
            for done in staged:
                if not done.done():
                    done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise  # cancelled: the monitor is stopping
            return
        for done in staged:
            if not done.done():
                done.set_result(None)
