"""Per-key limits for /v1, counted in Redis so they hold across web processes.

``Limiter.admit(key)`` before a request is proxied, ``Limiter.release(ticket,
tokens=...)`` once after it ends (success, error or client gone alike).

- **No limits, no Redis.** A key without limits gets a ticket straight away;
  admit and release make no round trip, so the hot path of unlimited keys
  pays only a function call.
- **One round trip per admit.** A Lua script checks all three limits and only
  then counts the request, atomically. A refused request therefore consumes
  nothing: not an RPM slot, not a concurrency slot. The RPM counter of a
  window is exactly the number of requests admitted in it, so a client that
  keeps hammering after a 429 does not push its own next window's math off,
  and a request refused for concurrency does not use up an RPM slot.
- **Windows.** RPM and TPM use fixed 60 s windows keyed by the minute of the
  Unix time (``mirbad:rl:{<key id>}:rpm:<minute>``), expiring after 120 s.
  Retry-After is the time to the end of the window, at least 1 s. Fixed
  windows allow up to twice the limit across a window boundary; that is the
  usual price of one counter per window. Each web process uses its own clock
  for the minute; NTP-synchronised hosts agree to milliseconds.
- **TPM** counts prompt + completion tokens, added at release into the window
  the request ended in (the size of an answer is known only then). Admission
  refuses once the window's count is at or over the limit, so requests
  already in flight may carry a window past it.
- **Concurrency, crash-safe.** The slots of a key are a sorted set of ticket
  ids scored by a lease deadline (``lease_seconds``, default 10 minutes).
  Admit drops expired leases before counting, release removes its own id
  (so a double release cannot remove someone else's slot, and the count can
  never go below 0). A web process that dies mid-request leaves leases that
  free themselves when they expire; nothing stays stuck. While the process
  lives, ``start()`` runs a task that extends the leases of its requests
  still in flight, so a stream longer than the lease keeps its slot. (A
  counter with a TTL refreshed on admit would never expire under steady
  traffic, leaking a crashed process's slots forever.)
- **Redis errors fail open**: the request is admitted and a warning logged
  (at most once a minute), see docs/decisions.md D23. Each Redis call is
  bounded by ``timeout`` seconds so a hung Redis cannot stall /v1, and after
  an error admits skip Redis for ``pause_after_error`` seconds, so an outage
  costs one timeout per pause, not one per request. An admit whose answer
  was lost (timeout, cancellation) may still have taken a slot in Redis; its
  ticket id is known, so the slot is given back in the background.

All keys of one API key share a hash tag, so the script also runs on a Redis
Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router import errors
from router.keys import KeyInfo

log = logging.getLogger("mirbad.router.limits")

WINDOW_SECONDS = 60
WINDOW_TTL = 120
DEFAULT_LEASE = 600.0
WARN_EVERY = 60.0

# KEYS: rpm window, tpm window, concurrency set.
# ARGV: rpm limit, tpm limit, concurrency limit (0 = none), now, lease deadline,
#       ticket id, window ttl, concurrency set ttl.
# Returns {0, 0} when admitted, else {1 rpm | 2 tpm | 3 concurrency, count seen}.
_ADMIT = """
local rpm_limit = tonumber(ARGV[1])
local tpm_limit = tonumber(ARGV[2])
local conc_limit = tonumber(ARGV[3])
if rpm_limit > 0 then
  local used = tonumber(redis.call('GET', KEYS[1]) or '0')
  if used >= rpm_limit then return {1, used} end
end
if tpm_limit > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used >= tpm_limit then return {2, used} end
end
if conc_limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[4])
  local held = redis.call('ZCARD', KEYS[3])
  if held >= conc_limit then return {3, held} end
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6])
  redis.call('EXPIRE', KEYS[3], ARGV[8])
end
if rpm_limit > 0 then
  if redis.call('INCR', KEYS[1]) == 1 then redis.call('EXPIRE', KEYS[1], ARGV[7]) end
end
return {0, 0}
"""


@dataclass(slots=True, eq=False)
class Ticket:
    """One admitted request. Release it exactly once; a second release is a no-op."""

    key_id: int
    id: str
    counts_tokens: bool = False  # the key has a TPM limit and Redis took the admit
    holds_slot: bool = False  # a concurrency slot is held in Redis
    released: bool = False


def _rpm_key(key_id: int, minute: int) -> str:
    return f"mirbad:rl:{{{key_id}}}:rpm:{minute}"


def _tpm_key(key_id: int, minute: int) -> str:
    return f"mirbad:rl:{{{key_id}}}:tpm:{minute}"


def _slots_key(key_id: int) -> str:
    return f"mirbad:rl:{{{key_id}}}:conc"


class Limiter:
    """Admits /v1 requests against a key's RPM, TPM and concurrency limits."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        clock: Callable[[], float] = time.time,
        lease_seconds: float = DEFAULT_LEASE,
        timeout: float = 0.5,
        pause_after_error: float = 5.0,
    ) -> None:
        self._redis = redis
        self._clock = clock
        self._lease = lease_seconds
        self._timeout = timeout
        self._admit_script = redis.register_script(_ADMIT)  # local: no round trip
        # Ticket ids: unique across processes by the random part, cheap by the counter.
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(6)
        self._live: dict[str, Ticket] = {}  # tickets holding a slot, for lease renewal
        self._refresher: asyncio.Task[None] | None = None
        self._cleanups: set[asyncio.Task[None]] = set()
        self._warned_at = -math.inf
        # After a Redis error, admit without asking for a while: an outage must not
        # add a connect timeout to every request of every limited key.
        self._pause_after_error = pause_after_error
        self._paused_until = -math.inf

    async def admit(self, key: KeyInfo) -> Ticket:
        """A ticket for one request, or ``V1Error`` 429 ``rate_limited`` with Retry-After."""
        ticket_id = f"{self._id_prefix}:{next(self._ids)}"
        if not key.limited or time.monotonic() < self._paused_until:
            return Ticket(key.id, ticket_id)
        now = self._clock()
        minute = int(now // WINDOW_SECONDS)
        try:
            async with asyncio.timeout(self._timeout):
                code, seen = await self._admit_script(
                    keys=[_rpm_key(key.id, minute), _tpm_key(key.id, minute), _slots_key(key.id)],
                    args=[
                        key.rpm_limit or 0,
                        key.tpm_limit or 0,
                        key.concurrency_limit or 0,
                        repr(now),
                        repr(now + self._lease),
                        ticket_id,
                        WINDOW_TTL,
                        math.ceil(self._lease * 2),
                    ],
                )
        except (RedisError, OSError, TimeoutError) as exc:
            self._forget_slot(key, ticket_id)
            self._paused_until = time.monotonic() + self._pause_after_error
            self._warn("admit", key, exc)
            return Ticket(key.id, ticket_id)  # fail open: the request is not counted
        except asyncio.CancelledError:
            self._forget_slot(key, ticket_id)
            raise
        if code == 0:
            ticket = Ticket(
                key.id,
                ticket_id,
                counts_tokens=bool(key.tpm_limit),
                holds_slot=bool(key.concurrency_limit),
            )
            if ticket.holds_slot:
                self._live[ticket_id] = ticket
            return ticket
        raise self._refusal(key, int(code), int(seen), now)

    async def release(self, ticket: Ticket, *, tokens: int) -> None:
        """Free the ticket's concurrency slot and add its tokens to the current TPM window."""
        if ticket.released:
            return
        ticket.released = True
        self._live.pop(ticket.id, None)
        add_tokens = ticket.counts_tokens and tokens > 0
        if not (add_tokens or ticket.holds_slot):
            return
        # Shielded: a request task cancelled while releasing must still free its slot.
        await asyncio.shield(self._release(ticket, tokens if add_tokens else 0))

    async def _release(self, ticket: Ticket, tokens: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        if ticket.holds_slot:
            pipe.zrem(_slots_key(ticket.key_id), ticket.id)
        if tokens:
            window = _tpm_key(ticket.key_id, int(self._clock() // WINDOW_SECONDS))
            pipe.incrby(window, tokens)
            pipe.expire(window, WINDOW_TTL)
        try:
            async with asyncio.timeout(self._timeout):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            # A lost slot frees itself when its lease ends; lost tokens are not retried.
            self._warn("release", ticket, exc)

    def _forget_slot(self, key: KeyInfo, ticket_id: str) -> None:
        """The script may have taken a slot whose answer never came back: give it back.

        Best effort, in the background; if Redis is away, the lease frees the slot.
        Without it, a few timeouts would block a key with a small concurrency
        limit for a whole lease.
        """
        if not key.concurrency_limit:
            return
        task = asyncio.get_running_loop().create_task(self._zrem(key.id, ticket_id))
        self._cleanups.add(task)  # a reference, or the task may be collected mid-way
        task.add_done_callback(self._cleanups.discard)

    async def _zrem(self, key_id: int, ticket_id: str) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(max(5.0, self._timeout)):
                await self._redis.zrem(_slots_key(key_id), ticket_id)

    async def refresh(self) -> None:
        """Extend the leases of this process's tickets still in flight (one round trip)."""
        if not self._live:
            return
        deadline = self._clock() + self._lease
        pipe = self._redis.pipeline(transaction=False)
        sets = set()
        for ticket in list(self._live.values()):
            # xx: never re-add a slot that a release removed meanwhile.
            pipe.zadd(_slots_key(ticket.key_id), {ticket.id: deadline}, xx=True)
            sets.add(_slots_key(ticket.key_id))
        for name in sets:  # the set itself must outlive the leases in it
            pipe.expire(name, math.ceil(self._lease * 2))
        try:
            async with asyncio.timeout(self._timeout * 4):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            self._warn("lease renewal", None, exc)

    def start(self) -> None:
        """Renew leases in the background (every third of the lease) until ``stop()``."""
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.create_task(self._refresh_loop(), name="limiter-leases")

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._lease / 3)
            await self.refresh()

    def _refusal(self, key: KeyInfo, code: int, seen: int, now: float) -> errors.V1Error:
        to_window_end = math.ceil(WINDOW_SECONDS - now % WINDOW_SECONDS)
        if code == 1:
            return errors.rate_limited(
                f"Rate limit reached for this API key: {key.rpm_limit} requests per minute. "
                f"Retry in {max(1, to_window_end)} s.",
                to_window_end,
            )
        if code == 2:
            return errors.rate_limited(
                f"Token limit reached for this API key: {key.tpm_limit} tokens per minute "
                f"({seen} used this minute). Retry in {max(1, to_window_end)} s.",
                to_window_end,
            )
        return errors.rate_limited(
            f"Concurrency limit reached for this API key: {key.concurrency_limit} requests "
            "at once. Retry when one of them has finished.",
            1,
        )

    def _warn(self, what: str, subject: KeyInfo | Ticket | None, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY:
            return
        self._warned_at = now
        key_id = getattr(subject, "id" if isinstance(subject, KeyInfo) else "key_id", None)
        log.warning(
            "Rate limiter %s failed (key %s): %r; requests are admitted without limits "
            "while Redis fails (further failures are not logged for %.0f s)",
            what,
            key_id,
            exc,
            WARN_EVERY,
        )
