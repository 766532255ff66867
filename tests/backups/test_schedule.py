"""Scheduled backups: due once a local day, claimed once, written atomically, pruned."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from backups import services
from backups.models import BackupRun
from backups.reader import parse
from tests.factories import make_model, make_node

pytestmark = pytest.mark.django_db


def _at(hour: int, minute: int = 0) -> dt.datetime:
    return dt.datetime.now().astimezone().replace(hour=hour, minute=minute, second=0)


def test_nothing_before_the_daily_time(backup_dir: Path) -> None:
    assert services.scheduled_tick(_at(2, 59)) is None
    assert not BackupRun.objects.exists()
    assert not backup_dir.exists()


def test_the_day_is_backed_up_once(backup_dir: Path, with_passphrase: str) -> None:
    make_model("alpha", node=make_node("n1"))
    run = services.scheduled_tick(_at(3, 0))
    assert run is not None and run.succeeded, run.error if run else None
    files = sorted(p.name for p in backup_dir.iterdir())
    assert files == [run.file_name]
    assert services.FILE_RE.match(run.file_name)
    path = backup_dir / run.file_name
    assert path.stat().st_mode & 0o777 == 0o600
    assert run.size_bytes == path.stat().st_size and run.has_secrets and run.has_ca
    backup = parse(path.read_bytes(), passphrase=with_passphrase)
    assert [m["servedName"] for m in backup.models] == ["alpha"]
    assert backup.ca is not None
    # Later ticks the same day make nothing more.
    assert services.scheduled_tick(_at(3, 1)) is None
    assert services.scheduled_tick(_at(23, 59)) is None
    assert BackupRun.objects.count() == 1


def test_without_a_passphrase_scheduled_backups_have_no_secrets(backup_dir: Path) -> None:
    run = services.scheduled_tick(_at(4))
    assert run is not None and run.succeeded and not run.has_secrets
    assert "secrets" not in json.loads((backup_dir / run.file_name).read_text())


def test_pruned_to_keep_newest_kept(settings: Any, backup_dir: Path) -> None:
    import dataclasses

    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, backup_keep=3)
    backup_dir.mkdir()
    old = [f"mirbadllm-backup-2026010{i}T030000Z.json" for i in range(1, 6)]
    for name in old:
        (backup_dir / name).write_text("{}")
    (backup_dir / "notes.txt").write_text("not ours")
    stale_temp = backup_dir / ".mirbadllm-backup-20260101T030000Z.json.abc.tmp"
    stale_temp.write_text("half")
    os.utime(stale_temp, (time.time() - 7200, time.time() - 7200))
    fresh_temp = backup_dir / ".mirbadllm-backup-x.json.def.tmp"
    fresh_temp.write_text("being written by another host")
    run = services.scheduled_tick(_at(3))
    assert run is not None and run.pruned == 3
    kept = sorted(p.name for p in backup_dir.iterdir() if services.FILE_RE.match(p.name))
    assert kept == [old[3], old[4], run.file_name]
    assert (backup_dir / "notes.txt").exists()
    assert not stale_temp.exists() and fresh_temp.exists()


def test_a_failure_is_recorded_and_retried_after_a_rest(settings: Any, tmp_path: Path) -> None:
    import dataclasses

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, backup_directory=blocker / "sub")
    run = services.scheduled_tick(_at(3))
    assert run is not None and not run.succeeded
    assert str(blocker / "sub") in run.error and run.day is None
    assert services.scheduled_tick(_at(3, 1)) is None  # resting
    BackupRun.objects.filter(pk=run.pk).update(
        started_at=timezone.now() - services.RETRY_AFTER - dt.timedelta(seconds=1)
    )
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, backup_directory=tmp_path / "ok")
    again = services.scheduled_tick(_at(3, 20))
    assert again is not None and again.succeeded


def test_a_killed_run_frees_its_day_after_a_while(backup_dir: Path) -> None:
    day = _at(3).date()
    dead = BackupRun.objects.create(
        kind="scheduled", day=day, started_at=timezone.now() - dt.timedelta(minutes=5)
    )
    assert services.scheduled_tick(_at(3, 5)) is None  # maybe still running
    BackupRun.objects.filter(pk=dead.pk).update(
        started_at=timezone.now() - services.STALE_CLAIM - dt.timedelta(seconds=1)
    )
    run = services.scheduled_tick(_at(3, 40))
    assert run is not None and run.succeeded
    dead.refresh_from_db()
    assert dead.day is None and "interrupted" in dead.error


def test_one_claim_per_day_even_when_two_race(backup_dir: Path) -> None:
    from django.db import IntegrityError, transaction

    day = _at(3).date()
    BackupRun.objects.create(kind="scheduled", day=day)
    with pytest.raises(IntegrityError), transaction.atomic():
        BackupRun.objects.create(kind="scheduled", day=day)


_KILLED_WRITER = r"""
import os, sys, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")
django.setup()
real_fsync = os.fsync
def slow_fsync(fd):
    # The file is written and flushed, not yet renamed: say so, then hang here.
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
        open(sys.argv[1], "w").close()
        time.sleep(60)
    real_fsync(fd)
os.fsync = slow_fsync
from backups import services
from backups.models import BackupRun
run = BackupRun.objects.create(kind="scheduled", day=None)
services.write_scheduled(run)
"""


@pytest.mark.django_db(transaction=True)
def test_kill_9_mid_write_leaves_no_file_under_a_final_name(
    backup_dir: Path, tmp_path: Path, settings: Any
) -> None:
    """A real process writing a real backup, killed while its temp file is written but
    not yet renamed: nothing under a backup's name, and the next run cleans up."""
    marker = tmp_path / "in-fsync"
    env = dict(os.environ, MIRBAD_BACKUP_DIRECTORY=str(backup_dir))
    env["MIRBAD_DATABASE_URL"] = _database_url(settings)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(marker)], env=env)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert child.poll() is None, "the writer ended before it reached the fsync"
        assert time.monotonic() < deadline, "the writer never reached the fsync"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    names = os.listdir(backup_dir)
    assert [n for n in names if services.FILE_RE.match(n)] == []
    temps = [n for n in names if services.TEMP_RE.match(n)]
    assert len(temps) == 1
    # The next successful run removes the leftover once it is clearly stale.
    os.utime(backup_dir / temps[0], (time.time() - 7200, time.time() - 7200))
    run = services.scheduled_tick(_at(3))
    assert run is not None and run.succeeded
    assert sorted(os.listdir(backup_dir)) == [run.file_name]


def _database_url(settings: Any) -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
