"""Per-key limits for /v1, counted in Redis so they hold across web processes.

``Limiter.admit(key)`` before a request is proxied, ``Limiter.release(ticket,
tokens=...)`` once after it ends (success, error or client gone alike); ``start()``
and ``stop()`` run the background task that talks to Redis between requests.

Redis is the only place where the processes of a master meet, but one round trip
per admit and one per release cost ~22 % of a web process's CPU per request. So
each process reserves from Redis in **blocks** and counts them down locally
(docs/decisions.md D24): a request with a limited key usually costs no round trip
at all, and the totals in Redis still bound what all processes together admit.

- **No limits, no Redis.** A key without limits gets a ticket straight away.
- **RPM: permits in blocks.** Fixed 60 s windows keyed by the minute of the Unix
  time (``mirbad:rl:{<key id>}:rpm:<minute>``, expiring after 120 s) count the
  permits *reserved* in the window. A process that has none left asks the script
  for a block; the script never reserves past the limit (a block is
  ``min(block, limit - reserved)``), so what all processes admit in a window can
  never exceed the limit. The block starts at 1, doubles while blocks last less
  than half a second and halves when they last over 4 s, and is never more than
  1 % of the limit (at most 10 000): a 60 RPM key reserves one permit per request,
  exactly as one counter would, and a 1e9 RPM key fetches about once a second.
  Permits a process did not use by the window's end are lost (the next window
  starts from 0), so a key can be refused a little before the limit when several
  processes each keep part of a block; ``stop()`` gives the current window's
  unused ones back. Once the script has said that a window is full, the process
  refuses locally until the window ends: a client hammering after a 429 costs
  nothing. Retry-After is the time to the end of the window, at least 1 s.
  Fixed windows allow up to twice the limit across a window boundary; that is
  the usual price of one counter per window. Each web process uses its own clock
  for the minute; NTP-synchronised hosts agree to milliseconds.
- **TPM** counts prompt + completion tokens. They are known only when a request
  ends, so ``release()`` adds them to a local tally, and the process adds the
  tally to the window it belongs to in the background (about every second, and
  on every script call, e.g. when it fetches a block of permits). Admission
  refuses once the window's known total (the count last read from Redis plus the
  local tally) is at or over the limit. Each process reads the count at its first
  request of a window and then about every second while the key is busy, so a
  window can overshoot the limit by up to ~1-2 s of the key's traffic on each
  process, plus the requests already running (which a check at admission can
  never stop).
- **Concurrency: leases in blocks, crash-safe.** Each process holds *one* lease
  per key: an entry ``<process id> -> slots`` in a hash
  (``mirbad:rl:{<key id>}:slots``), with its deadline in a sorted set
  (``...:leases``, ``lease_seconds``, default 10 minutes). A request takes a free
  slot of the process's lease; when there is none, the script grows the lease by a
  block (1 % of the limit, 1 to 256 slots), never past the limit summed over all
  leases. A release frees the slot locally. Idle slots go back to Redis: at once
  (in the background) when the process has more than two blocks idle, so a key
  with a limit under 200 (blocks of 1) gives each slot back as soon as its request
  ends, as a single counter would; the rest after a background round (about a
  second) in which the key saw no request, and everything at ``stop()``. A
  process that dies leaves a lease that expires with its deadline; the script of
  any process drops expired leases before counting. While the process lives, its
  background task renews its leases, so a stream longer than the lease keeps its
  slot. A lease found expired (renewal failed for a whole lease) counts as lost:
  its requests still in flight no longer hold counted slots, as before.
- **release() never waits for Redis**: it only updates the local books; a slot
  to give back is sent by a background task.
- **One round trip does everything.** A single Lua script flushes the token
  tally, reads the TPM window, reserves permits and grows, shrinks or renews the
  lease, atomically. When requests are waiting it first checks all three limits
  and reserves nothing if one refuses, so a request refused for concurrency does
  not use up an RPM permit. Admits of one key that need Redis at the same time
  share one call (the block is at least the number waiting), and the background
  round sends the calls of all keys in one pipeline.
- **Redis errors fail open**: the request is admitted and a warning logged (at
  most once a minute), see docs/decisions.md D23. Each round trip on the request
  path is bounded by ``timeout`` seconds so a hung Redis cannot stall /v1, and
  after an error admits skip Redis for ``pause_after_error`` seconds, so an outage
  costs one timeout per pause, not one per request. A call whose answer was lost
  (timeout, cancellation) may still have grown the lease in Redis; the process
  sends its true count in the background at once, so a few timeouts cannot block
  a key with a small concurrency limit for a whole lease. Tokens of a failed
  flush are not retried (the call may have counted them).

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
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from router import errors
from router.keys import KeyInfo
from router.limit_books import (  # noqa: F401  (re-exported: the tests and bench read them)
    _RPM,
    _SLOTS,
    _TPM,
    BLOCK_SHARE,
    DEFAULT_LEASE,
    FLUSH_EVERY,
    FORGET_AFTER,
    MAX_RPM_BLOCK,
    MAX_SLOT_BLOCK,
    REFILL_TARGET,
    WARN_EVERY,
    WINDOW_SECONDS,
    WINDOW_TTL,
    Ticket,
    _call_in_flight,
    _KeyBook,
    _Plan,
    _rpm_ceiling,
    _slot_block,
)
from router.limit_script import (
    FULL_RPM,
    FULL_SLOTS,
    SYNC,
    leases_key,
    rpm_key,
    slots_key,
    tpm_key,
)

log = logging.getLogger("mirbad.router.limits")


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
        self._script = redis.register_script(SYNC)  # local: no round trip
        self._script_loaded = False  # pipelines need it loaded; single calls load it
        # Ticket ids: unique across processes by the random part, cheap by the counter.
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(6)
        self.lease_id = self._id_prefix  # this process's entry in every key's leases
        self._books: dict[int, _KeyBook] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._tick_every = min(FLUSH_EVERY, lease_seconds / 3)
        self._last_round = -math.inf  # monotonic start of the last background round
        self._stopped = False
        self._background: set[asyncio.Task[None]] = set()
        self._warned_at = -math.inf
        # After a Redis error, admit without asking for a while: an outage must not
        # add a connect timeout to every request of every limited key.
        self._pause_after_error = pause_after_error
        self._paused_until = -math.inf

    # -- the request path -------------------------------------------------------------

    async def admit(self, key: KeyInfo) -> Ticket:
        """A ticket for one request, or ``V1Error`` 429 ``rate_limited`` with Retry-After."""
        ticket_id = f"{self._id_prefix}:{next(self._ids)}"
        if not key.limited or time.monotonic() < self._paused_until:
            return Ticket(key.id, ticket_id)
        book = self._books.get(key.id)
        if book is None:
            book = self._books[key.id] = _KeyBook(key)
        else:
            book.key = key
        registered = -1  # the epoch when this admit started waiting for Redis
        try:
            while True:
                now = self._clock()
                lack = self._take(book, key, now)
                if lack == 0:
                    book.admitted_at = time.monotonic()
                    book.in_flight += 1
                    return Ticket(
                        key.id,
                        ticket_id,
                        counts_tokens=bool(key.tpm_limit),
                        holds_slot=bool(key.concurrency_limit),
                        book=book,
                        owner=self,
                        generation=book.generation,
                    )
                refusal = self._known_refusal(book, key, lack, now, registered)
                if refusal is not None:
                    raise refusal
                if time.monotonic() < self._paused_until:
                    return Ticket(key.id, ticket_id)  # a call failed: fail open, uncounted
                if registered < 0:
                    registered = book.epoch
                    book.waiting += 1
                task = _call_in_flight(book) or self._start([book], timeout=self._timeout)
                try:
                    # A little over the call's own timeout, which normally ends it first
                    # (and pauses); this one bounds joining a slower background round.
                    async with asyncio.timeout(self._timeout * 1.2):
                        await asyncio.shield(task)  # a cancelled request must not cancel it
                except TimeoutError as exc:
                    self._warn("admit", key, exc)
                    return Ticket(key.id, ticket_id)
        finally:
            if registered >= 0:
                book.waiting -= 1
                # Slots reserved for this admit that it did not take (it failed open or
                # was cancelled) go back like any idle ones.
                if self._slot_target(book, idle_back=False) < book.held:
                    self._kick(book)

    def _take(self, book: _KeyBook, key: KeyInfo, now: float) -> int:
        """Admit from the local books (0), or say what is missing, as bits of
        ``_RPM | _TPM | _SLOTS`` (no await in here: checking and taking are atomic)."""
        minute = int(now // WINDOW_SECONDS)
        if book.rpm_window != minute:
            book.rpm_window, book.permits = minute, 0  # last window's permits are lost
        lack = 0
        if key.rpm_limit and book.permits <= 0:
            lack |= _RPM
        if key.tpm_limit and (
            book.tpm_window != minute
            or book.tpm_seen + book.pending.get(minute, 0) >= key.tpm_limit
        ):
            lack |= _TPM
        if key.concurrency_limit and book.held - book.used <= 0:
            lack |= _SLOTS
        if lack:
            return lack
        if key.rpm_limit:
            book.permits -= 1
        if key.concurrency_limit:
            book.used += 1
        return 0

    def _known_refusal(
        self, book: _KeyBook, key: KeyInfo, lack: int, now: float, registered: int
    ) -> errors.V1Error | None:
        """The 429 the books already prove, or None when Redis must be asked."""
        minute = int(now // WINDOW_SECONDS)
        if lack & _RPM and book.rpm_full == (minute, key.rpm_limit):
            return self._refusal(key, _RPM, 0, now)
        if lack & _TPM and book.tpm_window == minute:
            seen = book.tpm_seen + book.pending.get(minute, 0)
            if key.tpm_limit and seen >= key.tpm_limit:
                return self._refusal(key, _TPM, seen, now)
        # Slots free up at any time: only a call planned after this admit began waiting
        # (so it asked for this admit's slot too) may refuse it.
        if lack & _SLOTS and registered >= 0 and book.slots_full_epoch > registered:
            return self._refusal(key, _SLOTS, 0, now)
        return None

    async def release(self, ticket: Ticket, *, tokens: int) -> None:
        """Give the ticket's slot back to the process's lease and tally its tokens.

        Local bookkeeping only: nothing here waits for Redis (tokens and idle
        slots are sent by a background task).
        """
        if ticket.released:
            return
        ticket.released = True
        book, owner = ticket.book, ticket.owner
        if book is None or owner is None:
            return
        book.in_flight -= 1
        if ticket.counts_tokens and tokens > 0:
            minute = int(owner._clock() // WINDOW_SECONDS)
            book.pending[minute] = book.pending.get(minute, 0) + tokens
        # A ticket of a lost lease (expired, or given back by stop()) holds nothing.
        if ticket.holds_slot and ticket.generation == book.generation:
            book.used = max(0, book.used - 1)
            if owner._slot_target(book, idle_back=False) < book.held:
                owner._kick(book)

    # -- what to ask Redis ------------------------------------------------------------

    def _slot_target(self, book: _KeyBook, *, idle_back: bool) -> int:
        """How many slots the lease should hold now, with no request waiting.

        ``idle_back``: in a background round, the idle slots of a key that saw no
        request since the previous round go back too.
        """
        limit = book.key.concurrency_limit
        if not limit:
            return 0  # the limit was removed: nothing to hold
        free = book.held - book.used
        if free <= 0:
            return book.held
        if idle_back and book.admitted_at < self._last_round:
            return book.used
        keep = _slot_block(limit) - 1  # one block, less the slot that triggered it
        if free > 2 * keep:  # hysteresis: a release must not return one slot each time
            return book.used + keep
        return book.held

    def _plan(
        self, book: _KeyBook, now: float, *, final: bool, serve: bool, idle_back: bool
    ) -> _Plan:
        """Decide what this call asks for, and update the books as if it were sent.

        ``serve``: reserve for the admits waiting. Give-backs do not: a waiter may
        leave (fail open, cancelled) and leave a grown lease nobody uses.
        """
        key = book.key
        minute = int(now // WINDOW_SECONDS)
        book.epoch += 1
        need = serve and book.waiting > 0 and not final
        if book.rpm_window != minute:
            book.rpm_window, book.permits = minute, 0
        rpm_limit = key.rpm_limit or 0
        rpm_want = 0
        if final:
            rpm_want = -book.permits  # unused permits of this window go back
            book.permits = 0
        elif need and rpm_limit and book.permits < book.waiting:
            block = min(book.rpm_block, _rpm_ceiling(rpm_limit))
            rpm_want = max(block, book.waiting - book.permits)  # all who wait, at least
        # Tokens are sent once: a failed call drops them (it may have counted them).
        tokens_now = book.pending.pop(minute, 0)
        tokens_before = book.pending.pop(minute - 1, 0)
        book.pending.clear()  # older windows: nothing reads them any more
        conc = key.concurrency_limit or 0
        expected = book.held
        free = book.held - book.used
        if final:
            target = 0 if (book.held or book.dirty or book.used) else -1
            if target == 0:  # tickets still running no longer hold a counted slot
                book.generation += 1
                book.used = 0
        elif conc and need and free < book.waiting:
            target = max(book.held, book.used) + max(_slot_block(conc), book.waiting - max(free, 0))
        elif conc or book.held or book.dirty:
            target = self._slot_target(book, idle_back=idle_back)
        else:
            target = -1
        if 0 <= target < book.held:
            book.held = target  # slots on their way back are not handed out meanwhile
        key_id = key.id
        return _Plan(
            book=book,
            epoch=book.epoch,
            minute=minute,
            need=need,
            rpm_limit=rpm_limit,
            rpm_want=rpm_want,
            tpm_limit=key.tpm_limit or 0,
            target=target,
            expected=expected,
            keys=[
                rpm_key(key_id, minute),
                tpm_key(key_id, minute),
                tpm_key(key_id, minute - 1),
                leases_key(key_id),
                slots_key(key_id),
            ],
            args=[
                rpm_limit,
                rpm_want,
                key.tpm_limit or 0,
                tokens_now,
                tokens_before,
                conc,
                target,
                repr(now),
                repr(now + self._lease),
                self.lease_id,
                WINDOW_TTL,
                math.ceil(self._lease * 2),
                1 if need else 0,
            ],
        )

    def _apply(self, plan: _Plan, reply: list[Any], mono: float) -> None:
        code, granted, rpm_count, tpm_count, before, mine, total = (int(x) for x in reply)
        book = plan.book
        book.synced_at = mono
        if plan.rpm_want > 0:
            if granted > 0:
                ceiling = _rpm_ceiling(plan.rpm_limit)
                lasted = mono - book.rpm_fetched_at  # how long the previous block lasted
                if lasted < REFILL_TARGET / 2:
                    book.rpm_block = min(ceiling, book.rpm_block * 2)
                elif lasted > REFILL_TARGET * 4:
                    book.rpm_block = max(1, book.rpm_block // 2)
                book.rpm_fetched_at = mono
                # Reserved in a window that ended during the call: lost, never moved on.
                if book.rpm_window == plan.minute:
                    book.permits += granted
            if code == FULL_RPM or rpm_count >= plan.rpm_limit:
                book.rpm_full = (plan.minute, plan.rpm_limit)
        if plan.tpm_limit and book.tpm_window <= plan.minute:
            book.tpm_window, book.tpm_seen = plan.minute, tpm_count
        if plan.target >= 0:
            if before < plan.expected:
                # The lease expired in Redis (renewal failed for a whole lease): its
                # slots are free for anyone, so the requests still running hold none.
                book.generation += 1
                book.used = 0
            book.held = mine
            book.dirty = False
            if mine > 0:
                book.renewed_at = mono
            limit = book.key.concurrency_limit or 0
            grew = plan.need and plan.target > before
            if grew and (code == FULL_SLOTS or mine < plan.target or total >= limit):
                book.slots_full_epoch = plan.epoch

    # -- talking to Redis -------------------------------------------------------------

    def _start(
        self,
        books: list[_KeyBook],
        *,
        timeout: float,
        final: bool = False,
        quiet: bool = False,
        idle_back: bool = False,
    ) -> asyncio.Task[None]:
        """One script call (a pipeline for several keys), as the books' call in flight."""
        task = asyncio.get_running_loop().create_task(
            self._sync(books, within=timeout, final=final, quiet=quiet, idle_back=idle_back)
        )
        for book in books:
            book.sync = task

        def done(task: asyncio.Task[None]) -> None:
            self._background.discard(task)
            for book in books:  # also when cancelled before it ever ran
                if book.sync is task:
                    book.sync = None

        self._background.add(task)  # a reference, or the task may be collected mid-way
        task.add_done_callback(done)
        return task

    async def _sync(
        self,
        books: list[_KeyBook],
        *,
        within: float,
        final: bool,
        quiet: bool,
        idle_back: bool,
    ) -> None:
        failed: list[_Plan] = []
        cancelled = False
        plans: list[_Plan] = []
        try:
            if quiet and not any(
                b.dirty or self._slot_target(b, idle_back=False) < b.held for b in books
            ):
                return  # a give-back whose slots were taken again meanwhile: nothing to send
            now = self._clock()
            plans = [
                self._plan(b, now, final=final, serve=not quiet, idle_back=idle_back) for b in books
            ]
            async with asyncio.timeout(within):
                replies = await self._call(plans)
            mono = time.monotonic()
            errors_seen: list[BaseException] = []
            for plan, reply in zip(plans, replies, strict=True):
                if isinstance(reply, BaseException):  # one key's script failed in a pipeline
                    failed.append(plan)
                    errors_seen.append(reply)
                else:
                    self._apply(plan, reply, mono)
            if errors_seen:
                raise errors_seen[0]
        except (RedisError, OSError, TimeoutError) as exc:
            failed = failed or plans
            if isinstance(exc, NoScriptError):
                self._script_loaded = False  # Redis restarted: load it again next time
            if not quiet:
                self._paused_until = time.monotonic() + self._pause_after_error
                self._warn("call", books[0].key if len(books) == 1 else None, exc)
        except asyncio.CancelledError:
            failed, cancelled = plans, True  # the loop is closing: no new tasks
            raise
        finally:
            for book in books:
                if book.sync is asyncio.current_task():
                    book.sync = None
            for plan in failed:
                self._failed(plan, reconcile=not (quiet or final or cancelled))
            for book in books:
                if book.followup and _call_in_flight(book) is None:
                    book.followup = False
                    if self._slot_target(book, idle_back=False) < book.held:
                        self._kick(book)

    async def _call(self, plans: list[_Plan]) -> list[Any]:
        if len(plans) == 1:  # EVALSHA, loading the script on NOSCRIPT
            reply = await self._script(keys=plans[0].keys, args=plans[0].args)
            self._script_loaded = True
            return [reply]
        if not self._script_loaded:
            await self._redis.script_load(SYNC)
            self._script_loaded = True
        pipe = self._redis.pipeline(transaction=False)
        for plan in plans:
            pipe.evalsha(self._script.sha, len(plan.keys), *plan.keys, *plan.args)
        return await pipe.execute(raise_on_error=False)

    def _failed(self, plan: _Plan, *, reconcile: bool) -> None:
        """A call without an answer: Redis may have grown the lease; make it exact again."""
        book = plan.book
        if plan.target < 0:
            return
        book.dirty = True
        if reconcile and plan.target > plan.expected and not self._stopped:
            # Not subject to the pause, like any give-back: a key with a small
            # concurrency limit must not stay blocked until the lease ends.
            self._start([book], timeout=max(5.0, self._timeout), quiet=True)

    def _kick(self, book: _KeyBook) -> None:
        """Give idle slots back now, in the background (a release never waits)."""
        if self._stopped or time.monotonic() < self._paused_until:
            return  # the next background round does it
        if _call_in_flight(book) is not None:
            book.followup = True  # after the call in flight
            return
        self._start([book], timeout=self._timeout * 4, quiet=True)

    # -- the background round ---------------------------------------------------------

    async def refresh(self, *, force: bool = True) -> None:
        """One background round, now: send token tallies, give idle slots back,
        renew leases and re-read busy keys' TPM counts (one pipeline).

        ``force`` (the default, for callers and tests) renews every lease and
        re-reads every TPM count; the periodic round only does what is due.
        """
        await self._settle()
        mono = time.monotonic()
        due = [
            b
            for b in self._books.values()
            if _call_in_flight(b) is None and self._due(b, mono, force)
        ]
        self._forget_idle(mono)
        if due:
            task = self._start(due, timeout=self._timeout * 4, idle_back=True)
            await asyncio.shield(task)
        self._last_round = mono

    def _due(self, book: _KeyBook, mono: float, force: bool) -> bool:
        if book.pending or book.dirty:
            return True
        if (book.key.concurrency_limit or book.held) and self._slot_target(
            book, idle_back=True
        ) != book.held:
            return True
        if book.held > 0 and (force or mono - book.renewed_at >= self._lease / 6):
            return True
        busy = book.admitted_at > book.synced_at
        return bool(book.key.tpm_limit) and (
            force or (busy and mono - book.synced_at >= FLUSH_EVERY / 2)
        )

    def _forget_idle(self, mono: float) -> None:
        """Drop the books of keys idle for minutes: they hold and owe nothing."""
        for key_id, book in list(self._books.items()):
            if (
                mono - book.admitted_at > FORGET_AFTER
                and _call_in_flight(book) is None
                and not (book.in_flight or book.held or book.pending or book.dirty)
            ):
                del self._books[key_id]

    async def _settle(self) -> None:
        """Wait for the calls in flight (bounded: each has its own timeout)."""
        running = [t for t in self._background if not t.done()]
        if running:
            await asyncio.wait(running, timeout=max(5.0, self._timeout * 4))

    def start(self) -> None:
        """Run the background round (about every second) until ``stop()``."""
        self._stopped = False
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.create_task(self._refresh_loop(), name="limiter-rounds")

    async def stop(self) -> None:
        """End the background task; send the token tallies and give back every slot
        and this window's unused permits."""
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        self._stopped = True
        await self._settle()
        books = [b for b in self._books.values() if _call_in_flight(b) is None]
        books = [b for b in books if b.held or b.used or b.dirty or b.permits or b.pending]
        if books:
            task = self._start(books, timeout=self._timeout * 4, final=True)
            await asyncio.shield(task)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick_every)
            try:
                await self.refresh(force=False)
            except Exception:
                # A bug in one round must not end lease renewal for the process's life.
                log.exception("Rate limiter background round failed")

    # -- answers ----------------------------------------------------------------------

    def _refusal(self, key: KeyInfo, code: int, seen: int, now: float) -> errors.V1Error:
        to_window_end = math.ceil(WINDOW_SECONDS - now % WINDOW_SECONDS)
        if code == _RPM:
            return errors.rate_limited(
                f"Rate limit reached for this API key: {key.rpm_limit} requests per minute. "
                f"Retry in {max(1, to_window_end)} s.",
                to_window_end,
            )
        if code == _TPM:
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

    def _warn(self, what: str, key: KeyInfo | None, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY:
            return
        self._warned_at = now
        log.warning(
            "Rate limiter %s failed (key %s): %r; requests are admitted without limits "
            "while Redis fails (further failures are not logged for %.0f s)",
            what,
            key.id if key is not None else "several",
            exc,
            WARN_EVERY,
        )
