"""The limiter's local books: one process's reservations per key, its tickets and plans.

Split from ``router.limits`` (which holds the ``Limiter`` and its module docstring
with the whole design, docs/decisions.md D24): the constants that size blocks and
leases, the per-key books a process keeps, the ticket an admitted request holds, and
one key's part of a script call.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.keys import KeyInfo

if TYPE_CHECKING:
    from router.limits import Limiter

WINDOW_SECONDS = 60
WINDOW_TTL = 120
DEFAULT_LEASE = 600.0
WARN_EVERY = 60.0
# The background round: token tallies, idle slots, TPM readings, lease renewals.
FLUSH_EVERY = 1.0
# A block is at most this fraction of a limit: what one process can keep unused.
BLOCK_SHARE = 100
MAX_RPM_BLOCK = 10_000
MAX_SLOT_BLOCK = 256
# A block of permits should last about this long: one fetch a second per busy key.
REFILL_TARGET = 1.0
# A key's books are dropped after this long without requests (nothing held).
FORGET_AFTER = 2 * WINDOW_TTL

_RPM, _TPM, _SLOTS = 1, 2, 4  # what a request lacks (bits)


@dataclass(slots=True, eq=False)
class _KeyBook:
    """One process's local books for one key: what it reserved and what it owes Redis."""

    key: KeyInfo  # the latest seen: limits may change while the process runs
    # RPM: permits reserved in Redis for ``rpm_window`` and not yet used.
    rpm_window: int = -1
    permits: int = 0
    rpm_block: int = 1
    rpm_fetched_at: float = -math.inf  # monotonic
    rpm_full: tuple[int, int] | None = None  # (window, limit) the script said is full
    # TPM: the window's count at the last script call, and tokens not yet sent.
    tpm_window: int = -1
    tpm_seen: int = 0
    pending: dict[int, int] = field(default_factory=dict)  # minute -> tokens
    # Concurrency: slots of this process's lease in Redis, and how many are in use.
    held: int = 0
    used: int = 0
    generation: int = 0  # bumped when the lease is lost: older tickets hold nothing
    renewed_at: float = -math.inf  # monotonic
    slots_full_epoch: int = -1  # epoch of the last call that found no room
    dirty: bool = False  # a call failed: Redis may hold more than ``held``
    # The one script call in flight for this key, and who waits for it.
    sync: asyncio.Task[None] | None = None
    epoch: int = 0  # calls planned so far
    waiting: int = 0  # admits waiting for a call
    followup: bool = False  # a release wanted to give slots back during a call
    in_flight: int = 0  # tickets not yet released (the books cannot be dropped)
    admitted_at: float = -math.inf  # monotonic
    synced_at: float = -math.inf  # monotonic


@dataclass(slots=True, eq=False)
class Ticket:
    """One admitted request. Release it exactly once; a second release is a no-op."""

    key_id: int
    id: str
    counts_tokens: bool = False  # the key has a TPM limit and the admit was counted
    holds_slot: bool = False  # a slot of a lease in Redis is held
    released: bool = False
    # The books that admitted it (None when nothing was counted: no limits, fail open).
    book: _KeyBook | None = field(default=None, repr=False)
    owner: Limiter | None = field(default=None, repr=False)
    generation: int = 0


@dataclass(slots=True, eq=False)
class _Plan:
    """One key's part of a script call, computed when the call is sent."""

    book: _KeyBook
    epoch: int
    minute: int
    need: bool
    rpm_limit: int
    rpm_want: int
    tpm_limit: int
    target: int  # slots the lease should hold, -1 untouched
    expected: int  # slots the process believed its lease held
    keys: list[str]
    args: list[int | str]


def _call_in_flight(book: _KeyBook) -> asyncio.Task[None] | None:
    """The book's call still running. A finished one may linger until its done
    callback runs, and awaiting it would not yield: an admit would spin."""
    task = book.sync
    return task if task is not None and not task.done() else None


def _rpm_ceiling(limit: int) -> int:
    return max(1, min(limit // BLOCK_SHARE, MAX_RPM_BLOCK))


def _slot_block(limit: int) -> int:
    return max(1, min(limit // BLOCK_SHARE, MAX_SLOT_BLOCK))
