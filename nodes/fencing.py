"""The master's fencing identity and the one-active-monitor lock (docs/operator-guide.md, "Fencing and takeover").

``DATA_PATH/master.json`` holds the instance id (created once), the epoch
(raised and fsynced at every monitor start, before any agent call) and the
boot id of that start. Every master process reads it for every mutating agent
request, so web replicas and the monitor send the same triple.
"""

from __future__ import annotations

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
from typing import IO, Any

from protocol.atomic import write_atomic
from protocol.fencing import MASTER_HEADER, TIME_HEADER, Triple, verdict

log = logging.getLogger("mirbad.fencing")


class FencingError(Exception):
    """master.json is missing or unreadable; the message says what to do."""


# The master's identity is the fencing triple it sends (protocol.fencing).
MasterIdentity = Triple


def _path(data_path: Path) -> Path:
    return data_path / "master.json"


_cache: dict[str, tuple[float, MasterIdentity]] = {}


def read_identity(data_path: Path) -> MasterIdentity | None:
    """The current identity (cached until the file changes), or None before the first start."""
    path = _path(data_path)
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    hit = _cache.get(str(path))
    if hit is not None and hit[0] == mtime:
        return hit[1]
    try:
        data = json.loads(path.read_text())
        identity = Triple.from_json(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FencingError(f"{path} is unreadable ({exc}); restore it from a backup") from exc
    _cache[str(path)] = (mtime, identity)
    return identity


def begin_epoch(
    data_path: Path, *, at_least: int = 0, instance_id: str | None = None
) -> MasterIdentity:
    """Raise the epoch (and draw a new boot id) before this start talks to any agent.

    ``instance_id`` is given only by a rebuild from a backup, which keeps the old
    master's; otherwise the instance id is the one made at the first start.
    """
    current = read_identity(data_path)
    instance_id = instance_id or (current.instance_id if current else uuid.uuid4().hex[:16])
    epoch = max((current.epoch + 1) if current else 1, at_least)
    identity = MasterIdentity(instance_id, epoch, secrets.token_hex(8))
    write_atomic(
        _path(data_path),
        json.dumps(identity.to_json(), indent=2).encode(),
        mode=0o600,
        parents=True,
    )
    log.info(
        "Master identity %s: boot %s at epoch %d (data path %s).",
        instance_id,
        identity.boot_id,
        epoch,
        data_path,
    )
    return identity


def request_headers(data_path: Path) -> dict[str, str]:
    identity = read_identity(data_path)
    if identity is None:
        raise FencingError(
            f"{_path(data_path)} does not exist yet: the monitor has not started; start it first"
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
