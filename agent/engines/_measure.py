"""What an engine really uses, and one start at a time per GPU (docs/agent-api.md, "measured").

``Measured`` is an instance's measured memory as the agent reports and persists it;
``gpu_delta`` turns memory.used before and after a GPU start into one; ``GpuLocks``
serialises starts per GPU so each start's delta is its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeGuard

from agent._util import iso_time

__all__ = ["GPU_DELTA", "RSS", "GpuLocks", "Measured", "gpu_delta", "is_int"]

RSS, GPU_DELTA = "rss", "gpu-delta"
MIB = 2**20


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a true int (JSON's true/false are bools, and bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Measured:
    """What an instance's engine really uses, measured after Ready (docs/agent-api.md, "measured").

    ``kind`` is ``rss`` (the process group's resident memory, for a start without GPUs)
    or ``gpu-delta`` (the rise of memory.used on the placed GPUs over the start, with
    ``per_gpu`` by UUID). ``note`` says when a figure was clamped.
    """

    kind: str
    bytes: int
    at: float
    peak_bytes: int
    per_gpu: dict[str, int] | None = None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The instance's ``measured`` object."""
        out: dict[str, Any] = {
            "bytes": self.bytes,
            "kind": self.kind,
            "at": iso_time(self.at),
            "peakBytes": self.peak_bytes,
        }
        if self.per_gpu is not None:
            out["perGpu"] = dict(self.per_gpu)
        if self.note:
            out["note"] = self.note
        return out

    @classmethod
    def from_json(cls, data: Any) -> Measured | None:
        """A persisted measurement; None when the record has none or it is malformed."""
        if not isinstance(data, dict):
            return None
        kind, size, at = data.get("kind"), data.get("bytes"), data.get("at")
        if kind not in (RSS, GPU_DELTA) or not is_int(size) or not isinstance(at, str):
            return None
        try:
            moment = datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
        peak = data.get("peakBytes")
        per_gpu: dict[str, int] | None = None
        if kind == GPU_DELTA:
            raw = data.get("perGpu")
            items = raw.items() if isinstance(raw, dict) else ()
            per_gpu = {str(k): v for k, v in items if is_int(v)}
        note = data.get("note")
        return cls(
            kind=kind,
            bytes=size,
            at=moment,
            peak_bytes=max(peak, size) if is_int(peak) else size,
            per_gpu=per_gpu,
            note=note if isinstance(note, str) else None,
        )


class GpuLocks:
    """One start at a time per GPU: an asyncio.Lock per UUID, always taken in sorted order.

    Sorted order means two starts sharing GPUs can never each hold one the other waits
    for. ``free`` tells whether ``take`` would get every lock without waiting: none is
    held and no start is already queued for one (a queued start goes first).
    """

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: Counter[str] = Counter()

    def _lock(self, uuid: str) -> asyncio.Lock:
        return self._locks.setdefault(uuid, asyncio.Lock())

    def free(self, uuids: tuple[str, ...]) -> bool:
        """True when :meth:`take` would return without waiting."""
        return all(not self._lock(u).locked() and not self._waiting[u] for u in uuids)

    async def take(self, uuids: tuple[str, ...]) -> list[asyncio.Lock]:
        """Wait for every GPU's lock, in sorted order; on cancellation hold none of them."""
        held: list[asyncio.Lock] = []
        try:
            for uuid in sorted(set(uuids)):
                lock = self._lock(uuid)
                self._waiting[uuid] += 1
                try:
                    await lock.acquire()
                finally:
                    self._waiting[uuid] -= 1
                held.append(lock)
        except BaseException:
            self.release(held)
            raise
        return held

    @staticmethod
    def release(held: list[asyncio.Lock]) -> None:
        """Release locks :meth:`take` returned (each exactly once: the caller clears its list)."""
        for lock in held:
            lock.release()


def gpu_delta(uuids: tuple[str, ...], before: dict[str, int], after: dict[str, int]) -> Measured:
    """The rise of memory.used on ``uuids`` over a start, clamped at 0 per GPU."""
    per_gpu: dict[str, int] = {}
    fell: list[str] = []
    for uuid in uuids:
        delta = after[uuid] - before[uuid]
        if delta < 0:
            # Something else released memory during the start (the desktop, a
            # game closing); the engine cannot have a negative footprint.
            fell.append(f"{uuid} by {-delta / MIB:.0f} MiB")
            delta = 0
        per_gpu[uuid] = delta
    total = sum(per_gpu.values())
    note = None
    if fell:
        note = (
            "memory.used fell during the start on "
            + ", ".join(fell)
            + "; counted as 0 there, so this is below the real use"
        )
    return Measured(
        kind=GPU_DELTA, bytes=total, at=time.time(), peak_bytes=total, per_gpu=per_gpu, note=note
    )
