"""The daily backup through the real processes (issue 15): `mirbad up` with its own
Redis, Celery worker and beat; beat's tick finds the day's backup due, the worker
writes it sealed into the directory and prunes to MIRBAD_BACKUP_KEEP; the run is on
/api/backups and the file opens with the passphrase."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from backups.reader import parse
from backups.services import FILE_RE
from tests.e2e.conftest import wait_for

pytestmark = pytest.mark.slow
PASSPHRASE = "an e2e passphrase, long enough"


def test_beat_makes_the_days_backup_and_prunes(make_stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stack = make_stack(embedded=True)
    directory = tmp_path / "backups"
    directory.mkdir()
    older = [f"mirbadllm-backup-2026010{i}T030000Z.json" for i in range(1, 4)]
    for name in older:
        (directory / name).write_text("{}")
    secret = tmp_path / "passphrase"
    secret.write_text(PASSPHRASE + "\n")
    stack.env.update(
        {
            "MIRBAD_BACKUP_DIRECTORY": str(directory),
            "MIRBAD_BACKUP_DAILY_AT": "00:00",  # always passed: due at the first tick
            "MIRBAD_BACKUP_CHECK_SECONDS": "2",
            "MIRBAD_BACKUP_KEEP": "2",
            "MIRBAD_BACKUP_PASSPHRASE_FILE": str(secret),
        }
    )
    facts = stack.start()
    try:
        with stack.api(facts["API key"]) as api:

            def finished() -> list[dict[str, object]] | None:
                runs = api.get("/api/backups").json()["runs"]
                done = [r for r in runs if r["kind"] == "scheduled" and r["finishedAt"]]
                return done or None

            runs = wait_for(finished, 90, "the scheduled backup")
            assert len(runs) == 1 and runs[0]["error"] == "", runs
            run = runs[0]
            assert run["hasSecrets"] and run["hasCa"] and run["pruned"] == 2
            names = sorted(p.name for p in directory.iterdir() if FILE_RE.match(p.name))
            assert names == [older[2], run["fileName"]]
            data = (directory / str(run["fileName"])).read_bytes()
            assert len(data) == run["sizeBytes"]
            backup = parse(data, passphrase=PASSPHRASE)
            assert [n["nodeId"] for n in backup.nodes] == ["local"]
            assert backup.ca is not None and backup.api_keys  # the stack's local key
            # Several more ticks pass: still one backup for the day.
            time.sleep(6)
            assert len(finished() or []) == 1
    except BaseException:
        stack.print_logs()
        raise
    finally:
        stack.stop()
