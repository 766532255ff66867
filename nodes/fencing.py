"""The master's fencing identity and the one-active-monitor lock (docs/operator-guide.md, "Fencing and takeover").

The identity (instance id, made once; epoch, raised at every monitor start
before any agent call; the boot id of that start) is one row of the shared
database (:class:`~nodes.models.MasterState`, D81), so every process on every
master host sends the same triple with every mutating agent request. Readers
cache it for ``CACHE_SECONDS``; a mutation's headers read the row itself. An
earlier release's ``DATA_PATH/master.json`` is imported once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import fcntl
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction

from protocol.fencing import MASTER_HEADER, TIME_HEADER, Triple, verdict

log = logging.getLogger("mirbad.fencing")

# How long a process trusts the identity it read: a standby's takeover reaches the web
# processes of every host within this.
CACHE_SECONDS = 1.0


class FencingError(Exception):
    """The identity is missing or unreadable; the message says what to do."""


# The master's identity is the fencing triple it sends (protocol.fencing).
MasterIdentity = Triple


def _legacy_path(data_path: Path) -> Path:
    return data_path / "master.json"


_cache: dict[str, tuple[float, MasterIdentity | None]] = {}


def forget() -> None:
    """Drop the cached identity (tests; a process that changed the row behind us)."""
    _cache.clear()


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_T = TypeVar("_T")
_off_loop = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mirbad-db")


def off_loop(call: Callable[[], _T]) -> _T:
    """``call()``, run on a worker thread when this thread runs an event loop.

    Django refuses the ORM on a loop. The master's identity and certificates are read
    there (the monitor's and the router's clients) once per cache period: a single
    short query, so the loop waits for it rather than every caller becoming async.
    """
    if not _in_event_loop():
        return call()
    return _off_loop.submit(_closing, call).result()


def _closing(call: Callable[[], _T]) -> _T:
    from django.db import connections

    try:
        return call()
    finally:
        connections.close_all()  # this thread's, as a request's end would (CONN_MAX_AGE 0)


def _import_legacy(data_path: Path) -> MasterIdentity | None:
    """An earlier release's master.json, moved into the database once."""
    from nodes.models import MasterState

    path = _legacy_path(data_path)
    if not path.exists():
        return None
    try:
        identity = Triple.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FencingError(f"{path} is unreadable ({exc}); restore it from a backup") from exc
    try:
        with transaction.atomic():
            MasterState.objects.create(
                pk=1, instance_id=identity.instance_id, epoch=identity.epoch,
                boot_id=identity.boot_id,
            )  # fmt: skip
    except IntegrityError:
        pass  # another process imported it first
    path.rename(path.with_name("master.json.imported"))
    log.warning("Imported %s into the database (kept as master.json.imported)", path)
    return None


def _load(data_path: Path) -> MasterIdentity | None:
    from nodes.models import MasterState

    row = MasterState.objects.filter(pk=1).first()
    if row is None:
        _import_legacy(data_path)
        row = MasterState.objects.filter(pk=1).first()
    if row is None:
        return None
    return MasterIdentity(row.instance_id, row.epoch, row.boot_id)


def read_identity(data_path: Path) -> MasterIdentity | None:
    """The current identity (cached for CACHE_SECONDS), or None before the first start."""
    hit = _cache.get("identity")
    now = time.monotonic()
    if hit is not None and now < hit[0]:
        return hit[1]
    identity = off_loop(lambda: _load(data_path))
    _cache["identity"] = (now + CACHE_SECONDS, identity)
    return identity


async def aread_identity(data_path: Path) -> MasterIdentity | None:
    """:func:`read_identity` from async code: reads the database off the loop."""
    hit = _cache.get("identity")
    if hit is not None and time.monotonic() < hit[0]:
        return hit[1]
    return await sync_to_async(read_identity)(data_path)


def _raise_epoch(*, at_least: int, instance_id: str | None) -> MasterIdentity:
    from nodes.models import MasterState

    with transaction.atomic():
        row = MasterState.objects.select_for_update().filter(pk=1).first()
        if row is None:
            row = MasterState.objects.create(
                pk=1, instance_id=instance_id or uuid.uuid4().hex[:16], epoch=0, boot_id=""
            )
        row.instance_id = instance_id or row.instance_id
        row.epoch = max(row.epoch + 1, at_least)
        row.boot_id = secrets.token_hex(8)
        row.save()
        return MasterIdentity(row.instance_id, row.epoch, row.boot_id)


def begin_epoch(
    data_path: Path, *, at_least: int = 0, instance_id: str | None = None
) -> MasterIdentity:
    """Raise the epoch (and draw a new boot id) before this start talks to any agent.

    One transaction with the identity row locked (``SELECT ... FOR UPDATE`` on
    PostgreSQL; SQLite takes its write lock), so two hosts never draw the same epoch.
    ``instance_id`` is given only by a rebuild from a backup, which keeps the old
    master's; otherwise the instance id is the one made at the first start.
    """
    from nodes.models import MasterState

    if MasterState.objects.filter(pk=1).first() is None:
        _import_legacy(data_path)
    for attempt in range(2):
        try:
            identity = _raise_epoch(at_least=at_least, instance_id=instance_id)
            break
        except IntegrityError:
            if attempt:  # the first time another process created the row meanwhile
                raise
    _cache["identity"] = (time.monotonic() + CACHE_SECONDS, identity)
    log.info(
        "Master identity %s: boot %s at epoch %d.", identity.instance_id, identity.boot_id,
        identity.epoch,
    )  # fmt: skip
    return identity


def request_headers(data_path: Path) -> dict[str, str]:
    """The triple and the request time of one mutating agent request.

    Read from the row for every mutation, not from the cache: a triple a second old
    after a standby's takeover would be refused as stale_master by every agent that
    already accepted the new one. Mutations are rare; the query is one primary key.
    """
    identity = off_loop(lambda: _load(data_path))
    _cache["identity"] = (time.monotonic() + CACHE_SECONDS, identity)
    if identity is None:
        raise FencingError(
            "The master has no fencing identity yet: the monitor has not started; start it first"
        )
    return {
        MASTER_HEADER: identity.header(),
        TIME_HEADER: dt.datetime.now(dt.UTC).isoformat(),
    }


def outranks(agent_triple: dict[str, Any] | None, identity: MasterIdentity | None) -> bool:
    """True when the agent accepted a master this one cannot overrule (PendingTakeover)."""
    if not agent_triple or identity is None:
        return False
    try:
        accepted = Triple.from_json(agent_triple)
    except (KeyError, TypeError, ValueError):
        return False
    return verdict(accepted, identity) in ("stale", "competing")


_ADVISORY_KEY = int.from_bytes(hashlib.sha256(b"mirbad-monitor").digest()[:8], "big", signed=True)


class MonitorLock:
    """Held for the monitor's lifetime: a file lock, or a PostgreSQL advisory lock.

    With PostgreSQL several master hosts may share the database; the session
    advisory lock is released by the server when the holder's connection dies,
    so a standby waiting here takes over within one poll.
    """

    def __init__(self, *, data_path: Path, database_url: str) -> None:
        self.data_path = data_path
        self.database_url = database_url
        self._file: IO[str] | None = None
        self._conn: Any = None

    @property
    def kind(self) -> str:
        return (
            "postgres" if self.database_url.startswith(("postgres://", "postgresql://")) else "file"
        )

    def try_acquire(self) -> bool:
        if self.kind == "postgres":
            import psycopg

            if self._conn is None:
                self._conn = psycopg.connect(self.database_url, autocommit=True)
            row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (_ADVISORY_KEY,)).fetchone()
            return bool(row and row[0])
        self.data_path.mkdir(parents=True, exist_ok=True)
        if self._file is None:
            self._file = open(self.data_path / "monitor.lock", "w")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def acquire(self, *, should_stop: Callable[[], bool], poll: float = 2.0) -> bool:
        """Wait as a standby until the lock is ours; False if asked to stop first."""
        announced = False
        while not should_stop():
            if self.try_acquire():
                log.info("Monitor lock acquired (%s)", self.kind)
                return True
            if not announced:
                log.info("Standby: another monitor holds the lock (%s); waiting", self.kind)
                announced = True
            time.sleep(poll)
        return False

    def release(self) -> None:
        if self._conn is not None:
            import psycopg

            # Unlock before closing: the server frees a closed session's locks
            # only after its backend exits, which races a standby's next try.
            try:
                self._conn.execute("SELECT pg_advisory_unlock_all()")
            except psycopg.Error:  # a dead connection holds nothing to unlock
                log.debug("advisory unlock failed; closing the session frees it", exc_info=True)
            self._conn.close()
            self._conn = None
        if self._file is not None:
            self._file.close()
            self._file = None
