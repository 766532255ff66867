"""Failure throttles: failed logins and failed API key lookups, counted in Redis.

Two throttles share one rule: **past 10 failures in 15 minutes, refuse** (429 with
``Retry-After``, the seconds until the oldest failure that matters leaves the window)
without checking the password or looking the key up. Only failures count.

- **Logins** (console, Django admin; every path that calls Django's ``authenticate``
  records its failures through the ``user_login_failed`` signal) are counted per
  account (the user name as typed, known or not) and per source address. Either
  counter past the limit refuses. A success forgives only the failures of the same
  account from the same address, in both counters: a user who mistyped their own
  password is not held against their colleagues behind the same address, while an
  attacker who owns one account cannot wipe the failures of their guesses at others
  by logging into it (docs/decisions.md D36).
- **API keys** (``/v1`` and ``Bearer`` keys on ``/api``) are counted per source
  address only: a key that does not exist has no account. The router keeps the
  addresses it has seen refused in an in-process cache, so a valid key's request
  never waits for Redis (see :class:`KeyFailureThrottle`).

Windows slide: each counter is a sorted set of failure times (``mirbad:throttle:...``)
trimmed to the last 15 minutes by the Lua scripts below, timed by Redis' own clock,
so all web processes agree without synchronised clocks. A counter never holds more
than about ``MAX_FAILURES`` entries, because refused attempts are not failures.

IPv6 sources are counted per /64 (what one customer line usually gets, and a host
can pick any address in it); IPv4 sources per address. The source is the peer the
web server saw, so behind a reverse proxy it must pass the client's address on
(uvicorn trusts ``X-Forwarded-For`` from 127.0.0.1 by default), or every client
shares the proxy's counter.

Redis errors fail open, as the per-key limits do (docs/decisions.md D23): the
attempt goes through, a warning is logged at most once a minute, and Redis is left
alone for ``PAUSE_AFTER_ERROR`` seconds. Failures are always logged
(``mirbad.auth``), Redis or not.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import RedisError

log = logging.getLogger("mirbad.auth")

WINDOW_SECONDS = 15 * 60
MAX_FAILURES = 10
# A round trip on a request's path waits at most this long (the limiter's bound, D23).
REDIS_TIMEOUT = 0.5
PAUSE_AFTER_ERROR = 5.0
WARN_EVERY = 60.0

LOGIN_ACCOUNT = "mirbad:throttle:login:account:"
LOGIN_ADDRESS = "mirbad:throttle:login:address:"
KEY_ADDRESS = "mirbad:throttle:key:address:"

# Shared head of the scripts: trim each counter to the window, then the wait (ms) until
# the fullest one is under the limit again (0 = not blocked). Entries are sorted by
# time, so once a counter holds n >= limit entries, the one at index n - limit is the
# last that must leave before one more attempt is allowed.
_WAIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local function wait_ms()
  local worst = 0
  for _, key in ipairs(KEYS) do
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
    local n = redis.call('ZCARD', key)
    if n >= limit then
      local entry = redis.call('ZRANGE', key, n - limit, n - limit, 'WITHSCORES')
      local left = tonumber(entry[2]) + window - now
      if left > worst then worst = left end
    end
  end
  return worst
end
"""
# ARGV: window ms, limit. Returns the wait in ms.
CHECK = _WAIT + "return wait_ms()"
# ARGV: window ms, limit, member suffix (a nonce, then the tag FORGIVE matches), and
# "1" to record even past the limit. Returns {refused, wait ms, failures in the window
# of the first key}: refused = 1 when a counter was already full (nothing recorded).
# A login whose password was checked passes "1": logins that passed the check at the
# same moment are each a real guess, so each must count.
RECORD = (
    _WAIT
    + """
local before = wait_ms()
if before > 0 and ARGV[4] ~= '1' then
  return {1, before, redis.call('ZCARD', KEYS[1])}
end
local member = now .. ':' .. ARGV[3]
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now, member)
  redis.call('PEXPIRE', key, window)
end
return {0, wait_ms(), redis.call('ZCARD', KEYS[1])}
"""
)
# ARGV: member tag. Removes that tag's entries from every key; returns how many.
FORGIVE = """
local removed = 0
local suffix = ':' .. ARGV[1]
for _, key in ipairs(KEYS) do
  for _, member in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if string.sub(member, -string.len(suffix)) == suffix then
      removed = removed + redis.call('ZREM', key, member)
    end
  end
end
return removed
"""


def address_group(host: str | None) -> str:
    """The source a counter is kept for: an IPv4 address, or the /64 of an IPv6 one."""
    if not host:
        return "unknown"
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host[:64]
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


def _account_id(account: str) -> str:
    # Hashed: a user name is free text (any length, any character) and not ours to copy
    # into Redis key names.
    return hashlib.sha256(account.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _tag(account: str, address: str) -> str:
    """Marks a failure's entries with its (account, address) pair, for forgiving."""
    return hashlib.sha256(f"{account}\0{address}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _seconds(wait_ms: Any) -> int:
    return max(1, math.ceil(int(wait_ms) / 1000))


class _Breaker:
    """Fail open: after a Redis error, skip Redis for a while and warn once a minute."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._paused_until = 0.0
        self._warned_at = -math.inf

    def open(self) -> bool:
        return time.monotonic() < self._paused_until

    def failed(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        self._paused_until = now + PAUSE_AFTER_ERROR
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(
                "Redis unreachable for the failure throttle (%s: %s); letting attempts "
                "through unthrottled for now",
                what,
                type(exc).__name__,
            )


_breaker = _Breaker()
_sync_lock = threading.Lock()
_sync_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    """A client of its own, with the tight timeouts of a request's path."""
    global _sync_client
    with _sync_lock:
        if _sync_client is None:
            _sync_client = redis.Redis.from_url(
                settings.MIRBAD.redis_url,
                socket_timeout=REDIS_TIMEOUT,
                socket_connect_timeout=REDIS_TIMEOUT,
            )
        return _sync_client


def _run(script: str, keys: list[str], args: list[Any], what: str) -> Any:
    """Run a script, or None when Redis is failing (fail open)."""
    if _breaker.open():
        return None
    try:
        return _redis().register_script(script)(keys=keys, args=args)
    except (RedisError, OSError) as exc:
        _breaker.failed(what, exc)
        return None


# --- logins ----------------------------------------------------------------------------


def _login_keys(account: str, address: str | None) -> list[str]:
    """The account's counter first (its count is what the log line reports)."""
    keys = [LOGIN_ACCOUNT + _account_id(account)]
    if address is not None:  # authenticate() called without a request has no source
        keys.append(LOGIN_ADDRESS + address_group(address))
    return keys


def login_wait(account: str, address: str) -> int | None:
    """Seconds until a login for ``account`` from ``address`` may be tried, None if now."""
    wait = _run(
        CHECK,
        _login_keys(account, address),
        [WINDOW_SECONDS * 1000, MAX_FAILURES],
        "login check",
    )
    return _seconds(wait) if wait else None


def record_login_failure(account: str, address: str | None, path: str) -> None:
    """Count and log one failed login (never the password)."""
    answer = _run(
        RECORD,
        _login_keys(account, address),
        [
            WINDOW_SECONDS * 1000,
            MAX_FAILURES,
            f"{secrets.token_hex(4)}:{_tag(account, address or '')}",
            "1",
        ],
        "login failure",
    )
    count = f"{int(answer[2])} failures of the account" if answer else "not counted: no Redis"
    log.warning(
        "Failed login for account %r from %s on %s (%s in the last %d minutes)",
        account,
        address or "no address",
        path,
        count,
        WINDOW_SECONDS // 60,
    )


def forgive_login(account: str, address: str) -> None:
    """A login succeeded: drop the failures of this account from this address only."""
    _run(FORGIVE, _login_keys(account, address), [_tag(account, address)], "login success")


def login_refused(account: str, address: str, path: str, wait: int) -> None:
    """Log one refused attempt (a throttled attempt is not a failure: it is not counted)."""
    log.warning(
        "Refused login for account %r from %s on %s: over %d failures in %d minutes; retry in %d s",
        account,
        address,
        path,
        MAX_FAILURES,
        WINDOW_SECONDS // 60,
        wait,
    )


def reset() -> None:
    """Forget every failure counted, in Redis and in this process (tests; an operator's
    ``redis-cli --scan --pattern 'mirbad:throttle:*'`` does the Redis half by hand)."""
    client = _redis()
    for name in client.scan_iter(match="mirbad:throttle:*", count=1000):
        client.delete(name)
    key_failures.forget()
    _breaker.clear()


# --- API keys --------------------------------------------------------------------------


@dataclass(slots=True)
class KeyVerdict:
    """What a failed key lookup leads to: refused now (429) or just a 401."""

    refused: bool
    retry_after: int | None  # seconds until the address may try again, when blocked


class KeyFailureThrottle:
    """Failed API key lookups per source address, for ``/v1`` and ``/api`` alike.

    ``blocked(host)`` is what a request asks before its key is looked up: an in-process
    dictionary read (nothing at all while no address is blocked), never Redis. Redis
    is asked only after a lookup failed (``record``/``arecord``): the script counts the
    failure and says whether the address is now blocked, and for how long, which fills
    the local cache. So a blocked address is refused before any lookup by every process
    that has seen one of its failures since the block began; another process looks up
    at most one key of it, and that lookup's failure then learns the block.
    """

    def __init__(self) -> None:
        self._blocked: dict[str, float] = {}  # address group -> monotonic end of block
        self._async: dict[int, aioredis.Redis] = {}
        self._breaker = _Breaker()

    def blocked(self, host: str | None) -> int | None:
        """Seconds the address must still wait, or None (no Redis: a local read)."""
        if not self._blocked:
            return None
        group = address_group(host)
        until = self._blocked.get(group)
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            self._blocked.pop(group, None)
            return None
        return max(1, math.ceil(left))

    def _learn(self, group: str, answer: Any) -> KeyVerdict:
        refused, wait_ms = int(answer[0]), int(answer[1])
        if wait_ms > 0:
            if len(self._blocked) > 100_000:  # bounded: a flood of addresses cannot grow it
                self._blocked.clear()
            self._blocked[group] = time.monotonic() + wait_ms / 1000
        return KeyVerdict(refused=bool(refused), retry_after=_seconds(wait_ms) if wait_ms else None)

    def _log(self, host: str | None, where: str, prefix: str, verdict: KeyVerdict | None) -> None:
        if verdict is not None and verdict.refused:
            return  # refused attempts of a blocked address: logged when the block began
        log.warning(
            "Failed API key lookup on %s from %s (key starting %r)%s",
            where,
            host or "unknown",
            prefix,
            f"; blocked for {verdict.retry_after} s" if verdict and verdict.retry_after else "",
        )

    def record(self, host: str | None, *, where: str, prefix: str) -> KeyVerdict:
        """Count a failed lookup (blocking call, for /api)."""
        group = address_group(host)
        answer = None
        if not self._breaker.open():
            try:
                answer = _redis().register_script(RECORD)(
                    keys=[KEY_ADDRESS + group],
                    args=[WINDOW_SECONDS * 1000, MAX_FAILURES, secrets.token_hex(4)],
                )
            except (RedisError, OSError) as exc:
                self._breaker.failed("key failure", exc)
        verdict = self._learn(group, answer) if answer else None
        self._log(host, where, prefix, verdict)
        return verdict or KeyVerdict(refused=False, retry_after=None)

    async def arecord(self, host: str | None, *, where: str, prefix: str) -> KeyVerdict:
        """Count a failed lookup (for the router's event loop; bounded by REDIS_TIMEOUT)."""
        group = address_group(host)
        answer = None
        if not self._breaker.open():
            try:
                script = self._aredis().register_script(RECORD)
                answer = await asyncio.wait_for(
                    script(
                        keys=[KEY_ADDRESS + group],
                        args=[WINDOW_SECONDS * 1000, MAX_FAILURES, secrets.token_hex(4)],
                    ),
                    REDIS_TIMEOUT,
                )
            except (TimeoutError, RedisError, OSError) as exc:
                self._breaker.failed("key failure", exc)
        verdict = self._learn(group, answer) if answer else None
        self._log(host, where, prefix, verdict)
        return verdict or KeyVerdict(refused=False, retry_after=None)

    def _aredis(self) -> aioredis.Redis:
        """One client per event loop (redis.asyncio connections belong to their loop)."""
        loop_id = id(asyncio.get_running_loop())
        client = self._async.get(loop_id)
        if client is None:
            client = aioredis.Redis.from_url(
                settings.MIRBAD.redis_url,
                socket_timeout=REDIS_TIMEOUT,
                socket_connect_timeout=REDIS_TIMEOUT,
            )
            self._async = {loop_id: client}
        return client

    def forget(self) -> None:
        """Drop the local cache of blocked addresses and any pause after an error (tests)."""
        self._blocked.clear()
        self._breaker.clear()


# One per process: /v1 and /api share the local cache and the counters.
key_failures = KeyFailureThrottle()


def key_prefix(token: str) -> str:
    """The part of a presented key that may be logged (as keys.create_key stores it)."""
    return token[:10]
