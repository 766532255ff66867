"""Scheduled and on-demand backups (docs/operator-guide.md, "Backups").

A scheduled backup is due once per local day, from ``MIRBAD_BACKUP_DAILY_AT`` on:
beat asks every ``MIRBAD_BACKUP_CHECK_SECONDS``, so a master that was down at 03:00
makes the day's backup when it comes back. The day is claimed in the database
before anything is written (a unique constraint), so several workers or master hosts
make one backup a day between them. Files are written atomically and pruned to the
newest ``MIRBAD_BACKUP_KEEP``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from backups import crypto
from backups.document import build
from backups.models import BackupDownload, BackupRun
from core.errors import ServiceError
from protocol.atomic import write_atomic

log = logging.getLogger("mirbad.backups")

FILE_RE = re.compile(r"^mirbadllm-backup-\d{8}T\d{6}Z(-\d{1,3})?\.json$")
# What write_atomic leaves behind when the process is killed before the rename.
TEMP_RE = re.compile(r"^\.mirbadllm-backup-.*\.tmp$")
LINK_SECONDS = 600
# A claimed day whose run has not finished after this long was killed: claim it again.
STALE_CLAIM = dt.timedelta(minutes=30)
# A failed scheduled run is retried no sooner than this, not at every beat tick.
RETRY_AFTER = dt.timedelta(minutes=15)
TEMP_MAX_AGE_SECONDS = 3600


def _local_now() -> dt.datetime:
    """The master host's local time: the schedule is a wall-clock time where it runs."""
    return dt.datetime.now().astimezone()


def daily_time() -> dt.time:
    hours, minutes = settings.MIRBAD.backup_daily_at.split(":")
    return dt.time(int(hours), int(minutes))


def file_name_for(now: dt.datetime, directory: Path) -> str:
    stamp = now.astimezone(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    name = f"mirbadllm-backup-{stamp}.json"
    n = 1
    while (directory / name).exists():
        name = f"mirbadllm-backup-{stamp}-{n}.json"
        n += 1
    return name


def prune(directory: Path, keep: int) -> int:
    """Delete all but the newest ``keep`` backup files, and temp files a kill left."""
    try:
        names = sorted(n for n in os.listdir(directory) if FILE_RE.match(n))
    except FileNotFoundError:
        return 0
    removed = 0
    for name in names[: max(0, len(names) - keep)]:
        try:
            (directory / name).unlink()
            removed += 1
        except FileNotFoundError:
            pass  # another master host pruned it first
    now = time.time()
    for name in os.listdir(directory):
        path = directory / name
        if TEMP_RE.match(name):
            try:
                if now - path.stat().st_mtime > TEMP_MAX_AGE_SECONDS:
                    path.unlink()
            except FileNotFoundError:
                pass
    return removed


def _claim_day(day: dt.date, now: dt.datetime) -> BackupRun | None:
    """Claim the day's scheduled backup, or None when it is done, running or resting."""
    runs = BackupRun.objects.filter(kind=BackupRun.Kind.SCHEDULED)
    if runs.filter(day=day, finished_at__isnull=False).exists():
        return None  # done today
    # A run killed mid-way keeps its claim: free it once it is clearly dead.
    stale = runs.filter(day=day, finished_at__isnull=True, started_at__lt=now - STALE_CLAIM)
    stale.update(day=None, error="interrupted: the process running it stopped")
    if runs.filter(day=day).exists():
        return None  # another worker is making it now
    if runs.filter(started_at__gt=now - RETRY_AFTER).exclude(error="").exists():
        return None  # failed a moment ago: let the cause be fixed before trying again
    try:
        with transaction.atomic():
            return BackupRun.objects.create(
                kind=BackupRun.Kind.SCHEDULED, actor="beat", started_at=now, day=day
            )
    except IntegrityError:
        return None  # another worker claimed it between the check and the insert


def scheduled_tick(now: dt.datetime | None = None) -> BackupRun | None:
    """What beat runs: the day's backup when it is due, and the expired links purged."""
    purge_expired_downloads()
    local = (now or _local_now()).astimezone()
    if local.time() < daily_time():
        return None
    run = _claim_day(local.date(), timezone.now())
    if run is None:
        return None
    return write_scheduled(run)


def write_scheduled(run: BackupRun) -> BackupRun:
    """Write one scheduled backup into the directory and prune; the run records how it went."""
    cfg = settings.MIRBAD
    directory = cfg.backup_directory
    try:
        built = build(passphrase=cfg.backup_passphrase, include_ca=cfg.backup_include_ca)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = file_name_for(timezone.now(), directory)
        write_atomic(directory / name, built.data, mode=0o600)
        pruned = prune(directory, cfg.backup_keep)
    except (OSError, ServiceError) as exc:
        log.warning("The scheduled backup into %s failed: %s", directory, exc)
        BackupRun.objects.filter(pk=run.pk).update(
            finished_at=timezone.now(), day=None, error=f"{directory}: {exc}"[:500]
        )
        run.refresh_from_db()
        return run
    BackupRun.objects.filter(pk=run.pk).update(
        finished_at=timezone.now(),
        file_name=name,
        size_bytes=len(built.data),
        has_secrets=built.has_secrets,
        has_ca=built.has_ca,
        models_count=built.models,
        nodes_count=built.nodes,
        pruned=pruned,
    )
    log.info("Backup %s written (%d bytes, %d pruned)", directory / name, len(built.data), pruned)
    run.refresh_from_db()
    return run


# -- on demand --------------------------------------------------------------------------


@dataclass(frozen=True)
class OnDemand:
    run: BackupRun
    token: str
    expires_at: dt.datetime


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_passphrase(passphrase: object, field: str = "passphrase") -> str | None:
    """None or a passphrase that can seal a backup; a 400 naming the field otherwise."""
    if passphrase is None or passphrase == "":
        return None
    if not isinstance(passphrase, str):
        raise ServiceError(
            400, "invalid_request", f"{field} must be a string", details={"field": field}
        )
    problem = crypto.passphrase_problem(passphrase)
    if problem:
        raise ServiceError(400, "invalid_request", f"{field} {problem}", details={"field": field})
    return passphrase


def create_on_demand(*, actor: str, passphrase: str | None, include_ca: bool) -> OnDemand:
    """Build a backup now and keep it behind a one-time link that expires in 10 minutes."""
    now = timezone.now()
    built = build(passphrase=passphrase, include_ca=include_ca)
    token = secrets.token_urlsafe(24)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    expires = now + dt.timedelta(seconds=LINK_SECONDS)
    with transaction.atomic():
        run = BackupRun.objects.create(
            kind=BackupRun.Kind.ON_DEMAND,
            actor=actor[:150],
            started_at=now,
            finished_at=timezone.now(),
            file_name=f"mirbadllm-backup-{stamp}.json",
            size_bytes=len(built.data),
            has_secrets=built.has_secrets,
            has_ca=built.has_ca,
            models_count=built.models,
            nodes_count=built.nodes,
        )
        BackupDownload.objects.create(
            run=run,
            token_hash=_hash(token),
            file_name=run.file_name,
            content=built.data,
            expires_at=expires,
        )
    return OnDemand(run=run, token=token, expires_at=expires)


def take_download(token: str) -> tuple[str, bytes]:
    """The file behind a one-time link; the link is spent by this call."""
    if not isinstance(token, str) or not re.fullmatch(r"[A-Za-z0-9_-]{16,64}", token):
        raise ServiceError(404, "not_found", "No such download link.")
    with transaction.atomic():
        row = BackupDownload.objects.select_for_update().filter(token_hash=_hash(token)).first()
        if row is None:
            raise ServiceError(
                404, "not_found", "No such download link: it was used already or never existed."
            )
        expired = row.expires_at <= timezone.now()
        name, content = row.file_name, bytes(row.content)
        row.delete()
    if expired:
        raise ServiceError(410, "link_expired", "This download link expired; make a new backup.")
    return name, content


def purge_expired_downloads() -> int:
    deleted, _ = BackupDownload.objects.filter(expires_at__lte=timezone.now()).delete()
    return deleted


def recent_runs(limit: int = 50) -> list[BackupRun]:
    return list(BackupRun.objects.all()[:limit])
