"""Mutations that finish even when the master hangs up (shared by the route modules)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["complete"]

T = TypeVar("T")


async def complete(operation: Coroutine[Any, Any, T]) -> T:
    """Run a mutation to its end even if the master hangs up meanwhile.

    aiohttp cancels a handler whose client disconnects; a launch or stop cut short
    half way could leave an instance Starting without a process, or a process nobody
    supervises. The shielded task finishes; only the answer is lost.
    """
    task = asyncio.ensure_future(operation)
    task.add_done_callback(_consume_result)
    return await asyncio.shield(task)


def _consume_result(task: asyncio.Task[Any]) -> None:
    # Marks the exception as retrieved when nobody is left to await the task.
    if not task.cancelled():
        task.exception()
