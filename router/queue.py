"""The fair queue: at most ``capacity`` requests per replica, the rest wait in line.

Each replica serves at most its capacity at once (llama.cpp's ``parallel`` slots,
vLLM's ``max_num_seqs``; router.routing.Route.capacity), counted in Redis so the
bound holds across every web process. A request that finds every slot of its
served name busy waits in that name's queue, also in Redis:

- **Order**: by the key's priority (higher first), then round robin across the keys
  of that priority (one key with a thousand requests queued does not starve a key
  with one), then arrival. router/queue_script.py holds the Lua.
- **Hand-over**: a request that ends frees its slot and, in the same script, gives
  it to the head of the queue; the waiter's process hears it on its own Redis
  channel at once. Every waiter also polls about twice a second, which covers a
  lost message and a replica that became ready (new slots, nobody releasing).
- **Bounds**: at most ``queue_max`` waiting per name (the model's, else
  MIRBAD_QUEUE_MAX; a full queue is ``429 queue_full`` at once) and each waits at
  most ``queue_timeout`` seconds (the smaller of the key's and the model's, else
  MIRBAD_QUEUE_TIMEOUT; then ``429 queue_timeout``). Both carry Retry-After: the
  queue's depth times the name's recent slot time over its capacity, at least 1 s.
  A client that disconnects while queued leaves the queue.
- **Crashes**: every process holds a lease per name it uses (15 s, renewed while it
  has requests there); a process that dies loses its slots and its place in line
  when the lease lapses, at the next script run of any process.
- **Redis away**: the queue fails open, as the limits do (docs/decisions.md D23):
  the request goes to the replica with the fewest requests in flight in this
  process, and a warning is logged at most once a minute.

Cost: one script call before a request and one after it (the release does not
hold the answer up: it runs in the background). The wait of each request is in
``x-mirbad-queue-ms`` and ``mirbad_v1_queue_wait_seconds``; the depth per name in
``mirbad_router_queue_depth`` and the console's model rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from nodes import status_cache
from router.errors import queue_full, queue_timeout
from router.queue_wire import lean_for
from router.relay import ClientGone, Receive

log = logging.getLogger("mirbad.router.queue")

LEASE_SECONDS = 15.0
POLL_EVERY = 0.5
RENEW_EVERY = 5.0
WARN_EVERY = 60.0
CALL_TIMEOUT = 0.5  # one script call; past it the queue fails open (as a status read)
PROBE_EVERY = 1.0  # after a failure, how often a background call asks Redis again
RELEASE_TRIES = 8  # a release that fails is sent again, 2 s to 30 s apart


def base(served_name: str) -> str:
    """The prefix of one served name's keys (one hash tag)."""
    return f"mirbad:q:{{{served_name}}}:"


@dataclass(slots=True)
class Grant:
    """One slot held on one replica; ``release`` it exactly once."""

    name: str
    ticket: str
    instance_id: str
    waited: float  # seconds in the queue (0 when a slot was free)
    granted_at: float
    counted: bool = True  # False when the queue failed open: nothing to release


@dataclass(frozen=True, slots=True)
class Entry:
    """What the queue needs of a request: who asks, for what, where it may go."""

    name: str
    capacities: Sequence[tuple[str, int]]  # (instance id, slots) of replicas taking traffic
    priority: int
    key_id: int
    bound: int  # most waiting on the name
    timeout: float  # most seconds this request waits


class FairQueue:
    """One web process's side of the queue (one per event loop: redis.asyncio)."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        clock: Callable[[], float] = time.time,
        lease_seconds: float = LEASE_SECONDS,
        poll_every: float = POLL_EVERY,
        call_timeout: float = CALL_TIMEOUT,
    ) -> None:
        self._redis = redis
        self._clock = clock
        self._lease = lease_seconds
        self._poll_every = poll_every
        self.process_id = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._scripts: dict[str, Any] = {}
        self._texts: dict[str, str] = {}
        from router import queue_script

        for name in ("ACQUIRE", "POLL", "RELEASE", "LEAVE", "RENEW"):
            self._texts[name] = getattr(queue_script, name)
            self._scripts[name] = redis.register_script(self._texts[name])
        self._timeout = call_timeout
        # The script calls on the request path go over a lean pipelined connection
        # (router.queue_wire); redis-py stays for pub/sub, the readers and TLS.
        self._lean = lean_for(redis, timeout=call_timeout)
        # After a failure no request waits on Redis again until a background probe
        # got an answer: a stalled Redis costs one timeout, not one per request.
        self._healthy = True
        self._probe: asyncio.Task[None] | None = None
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._held: dict[str, int] = {}  # served name -> slots and waiters of this process
        self._slot_time: dict[str, float] = {}  # served name -> recent seconds per request
        self._listener: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._warned_at = -math.inf

    # -- the request path ---------------------------------------------------------

    async def acquire(
        self,
        entry: Entry,
        *,
        receive: Receive | None = None,
        capacities_now: Callable[[], Awaitable[Sequence[tuple[str, int]]]] | None = None,
    ) -> Grant | None:
        """A slot for ``entry``, at once or after a wait in line; None when Redis
        failed (the caller then picks a replica itself, uncounted).

        Raises ``V1Error`` 429 ``queue_full``/``queue_timeout``, or ``ClientGone``
        when ``receive`` says the client left while it waited. ``capacities_now``
        gives the replicas taking traffic at each poll (a replica may become ready
        or go away while requests wait).
        """
        if not self.usable():
            return None
        started = time.monotonic()
        ticket = f"{self.process_id}:{next(self._ids)}"
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = future
        self._hold(entry.name, +1)
        granted = False
        try:
            try:
                answer = await self._call(
                    "ACQUIRE", entry.name, entry.capacities,
                    ticket, entry.priority, entry.key_id, entry.bound,
                )  # fmt: skip
            except (TimeoutError, RedisError, OSError) as exc:
                self._failed(exc)
                # The call may have run and granted or queued the ticket: undo that in
                # the background, or a slot would stay counted while this process lives.
                self._spawn(self._leave(entry, ticket, entry.capacities))
                return None
            status, detail = answer
            if status == "ok":
                granted = True
                return self._grant(entry.name, ticket, detail, started)
            if status == "full":
                raise queue_full(entry.name, int(detail), self.retry_after(entry, int(detail)))
            instance = await self._wait(entry, ticket, future, started, receive, capacities_now)
            granted = True
            return self._grant(entry.name, ticket, instance, started)
        finally:
            self._waiting.pop(ticket, None)
            if not granted:
                self._hold(entry.name, -1)

    async def _wait(
        self,
        entry: Entry,
        ticket: str,
        future: asyncio.Future[str],
        started: float,
        receive: Receive | None,
        capacities_now: Callable[[], Awaitable[Sequence[tuple[str, int]]]] | None,
    ) -> str:
        """Wait in line until granted; leaves the line on timeout, disconnect or error."""
        self._ensure_listener()
        deadline = started + entry.timeout
        gone: asyncio.Task[Any] | None = None
        if receive is not None:
            gone = asyncio.ensure_future(_disconnected(receive))
        capacities = entry.capacities
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                waiters: list[asyncio.Future[Any]] = [future]
                if gone is not None:
                    waiters.append(gone)
                await asyncio.wait(waiters, timeout=min(self._poll_every, left),
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if future.done():
                    return future.result()
                if gone is not None and gone.done():
                    raise ClientGone
                if capacities_now is not None:
                    capacities = await capacities_now()
                try:
                    status, detail = await self._call("POLL", entry.name, capacities, ticket)
                except (TimeoutError, RedisError, OSError) as exc:
                    self._warn(exc)
                    continue  # the deadline still bounds the wait
                if status == "ok":
                    return detail
                if status == "lost":
                    # Swept as if this process had died (its lease lapsed under a long
                    # stall): queue again at the back rather than fail.
                    try:
                        status, detail = await self._call(
                            "ACQUIRE", entry.name, capacities,
                            ticket, entry.priority, entry.key_id, entry.bound,
                        )  # fmt: skip
                    except (TimeoutError, RedisError, OSError) as exc:
                        self._warn(exc)
                        continue
                    if status == "ok":
                        return detail
                    if status == "full":
                        retry = self.retry_after(entry, int(detail))
                        raise queue_full(entry.name, int(detail), retry)
            waited = time.monotonic() - started
            raise queue_timeout(entry.name, waited, self.retry_after(entry, entry.bound))
        except BaseException:
            # Whatever ends the wait without a grant: out of the line, or, when the
            # grant raced in, the slot handed on. Shielded: a cancelled request must
            # not leave its ticket holding a place or a slot.
            await asyncio.shield(self._leave(entry, ticket, capacities))
            raise
        finally:
            if gone is not None and not gone.done():
                gone.cancel()

    async def _leave(
        self, entry: Entry, ticket: str, capacities: Sequence[tuple[str, int]]
    ) -> None:
        try:
            await self._call("LEAVE", entry.name, capacities, ticket)
        except (TimeoutError, RedisError, OSError) as exc:
            # The lease sweeps it if this process dies; until then the place is held.
            self._warn(exc)

    def _grant(self, name: str, ticket: str, instance: str, started: float) -> Grant:
        now = time.monotonic()
        return Grant(name, ticket, instance, now - started, now)

    def release(self, grant: Grant | None, capacities: Sequence[tuple[str, int]]) -> None:
        """Free the slot and hand it on, in the background (the answer is already sent)."""
        if self._releasing(grant):
            assert grant is not None
            self._spawn(self._release(grant, capacities))

    async def release_now(self, grant: Grant | None, capacities: Sequence[tuple[str, int]]) -> None:
        """Free the slot and hand it on before returning: the engine's slot is idle
        until the next request reaches it, so the hand-over is not left to a turn of
        a busy event loop. Cancelling the caller does not cancel the release."""
        if self._releasing(grant):
            assert grant is not None
            task = asyncio.ensure_future(self._release(grant, capacities))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            if self._healthy:
                # Bounded by one call's timeout: a failed release retries in the background.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(task), self._timeout)

    def _releasing(self, grant: Grant | None) -> bool:
        if grant is None or not grant.counted:
            return False
        grant.counted = False
        held = time.monotonic() - grant.granted_at
        previous = self._slot_time.get(grant.name)
        self._slot_time[grant.name] = held if previous is None else previous * 0.9 + held * 0.1
        return True

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, grant: Grant, capacities: Sequence[tuple[str, int]]) -> None:
        """Sent until Redis takes it (a counted slot left behind would hold a replica's
        slot while this process lives); the lease frees it if this process dies first."""
        for attempt in range(RELEASE_TRIES):
            if attempt:
                await asyncio.sleep(min(2.0**attempt, 30.0))
            if await self._release_once(grant, capacities):
                return
        log.warning("A slot of %s could not be released; it is freed when this process ends",
                    grant.name)  # fmt: skip

    async def _release_once(self, grant: Grant, capacities: Sequence[tuple[str, int]]) -> bool:
        try:
            waited = f"{grant.waited * 1000:.1f}"
            granted = await self._call("RELEASE", grant.name, capacities, grant.ticket, waited)
            for note in granted:
                ticket, _, instance = note.partition("\t")
                future = self._waiting.get(ticket)
                if future is not None and not future.done():
                    future.set_result(instance)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            return False
        self._hold(grant.name, -1)
        return True

    async def full(self, name: str, bound: int) -> bool:
        """Whether ``name``'s line holds ``bound`` waiters already (a request would be
        refused ``queue_full`` unless a slot is free and nobody waits). Redis away: not
        full, as the queue fails open."""
        if not self.usable():
            return False
        try:
            waiting = int(await asyncio.wait_for(self._redis.hlen(base(name) + "waiters"),
                                                 self._timeout))  # fmt: skip
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            return False
        return waiting > 0 and waiting >= bound

    def retry_after(self, entry: Entry, depth: int) -> int:
        """Seconds until a request joining now would likely be served."""
        slots = sum(c for _, c in entry.capacities) or 1
        per_request = self._slot_time.get(entry.name, 1.0)
        return max(1, min(int(entry.timeout), math.ceil(depth * per_request / slots)))

    # -- Redis --------------------------------------------------------------------

    async def _call(
        self, script: str, name: str, capacities: Sequence[tuple[str, int]], *rest: Any
    ) -> list[str]:
        args: list[Any] = [base(name), f"{self._clock():.3f}", self.process_id, self._lease,
                           len(capacities)]  # fmt: skip
        for instance, capacity in capacities:
            args += [instance, capacity]
        args += list(rest)
        if self._lean is not None:
            answer = await self._lean.evalsha(self._texts[script], *args)
        else:
            answer = await asyncio.wait_for(self._scripts[script](args=args), self._timeout)
        if isinstance(answer, list):
            return [_text(a) for a in answer]
        return [_text(answer)]

    def _hold(self, name: str, delta: int) -> None:
        """Count this process's slots and waiters per name: the lease is renewed for
        names with any."""
        count = self._held.get(name, 0) + delta
        if count > 0:
            self._held[name] = count
            if self._renewer is None or self._renewer.done():
                self._renewer = asyncio.ensure_future(self._renew_loop())
        else:
            self._held.pop(name, None)

    async def _renew_loop(self) -> None:
        while self._held:
            await asyncio.sleep(RENEW_EVERY)
            for name in list(self._held):
                with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                    await self._call("RENEW", name, ())

    def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        """Grants for this process's waiters, published by whoever freed the slot."""
        channel = f"mirbad:q:grant:{self.process_id}"
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    ticket, _, instance = _text(message.get("data", "")).partition("\t")
                    future = self._waiting.get(ticket)
                    if future is not None and not future.done():
                        future.set_result(instance)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # polling still hands slots over meanwhile
                self._warn(exc)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped

    async def settle(self) -> None:
        """Wait for the releases and leaves sent in the background."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def stop(self) -> None:
        """Release what is pending and stop the background tasks."""
        await self.settle()
        if self._lean is not None:
            self._lean.close()
        for task in (self._listener, self._renewer, self._probe):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def usable(self) -> bool:
        """Whether a request may call Redis now. Not after a failure (this queue's, or a
        status read's: nodes.status_cache.reads_paused) until a background probe has
        had an answer; meanwhile requests are served without the queue."""
        if self._healthy and not status_cache.reads_paused():
            return True
        self._healthy = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._check())
        return False

    async def _check(self) -> None:
        try:
            await self._call("RENEW", "-probe-", ())
        except (TimeoutError, RedisError, OSError) as exc:
            self._warn(exc)
            await asyncio.sleep(PROBE_EVERY)  # the next request after this starts another
            return
        self._healthy = True
        log.info("The fair queue reaches Redis again")

    def _failed(self, exc: BaseException) -> None:
        self._healthy = False
        self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("The fair queue cannot reach Redis; serving without it: %r", exc)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (the body was read already)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def shuffled(capacities: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Ties between replicas go to the first listed: shuffle so they spread."""
    random.shuffle(capacities)
    return capacities


# -- readers for the console, /metrics and the load-on-demand logic (sync) -----------


def busy_slots(served_name: str) -> int:
    """Slots in use for ``served_name`` (requests in flight) across all web processes."""
    values = status_cache.sync_client().hvals(base(served_name) + "busy")
    return sum(max(0, int(v)) for v in values)


def last_used(served_name: str) -> float | None:
    """Unix time of the latest request for ``served_name``, or None."""
    value = status_cache.sync_client().get(base(served_name) + "last")
    return float(value) if value is not None else None


def snapshot(served_names: Sequence[str]) -> dict[str, tuple[int, float | None]]:
    """(requests waiting, ms the latest answered one waited) per served name, in one
    round trip; {} when Redis cannot be read (the console then shows none)."""
    if not served_names:
        return {}
    try:
        pipe = status_cache.sync_client().pipeline(transaction=False)
        for name in served_names:
            pipe.hlen(base(name) + "waiters")
            pipe.get(base(name) + "wait")
        answers = pipe.execute()
    except (RedisError, OSError) as exc:
        log.warning("Reading the queues' depth failed: %r", exc)
        return {}
    out: dict[str, tuple[int, float | None]] = {}
    for i, name in enumerate(served_names):
        waited = answers[2 * i + 1]
        out[name] = (int(answers[2 * i]), float(waited) if waited is not None else None)
    return out
