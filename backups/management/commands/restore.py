"""``manage.py restore FILE``: preview a backup, restore its definitions, or rebuild.

    restore FILE --preview            what a restore would do; nothing changes
    restore FILE [--models a,b]       write the definitions, merge the API keys, then fetch
                                      missing folders and start the auto-start models
    restore FILE --rebuild            make this empty master the fleet's master again

The passphrase comes from ``--passphrase-file`` or ``MIRBAD_RESTORE_PASSPHRASE`` (or
its ``_FILE``); without one the sealed secrets stay closed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from backups import fleet_restore, restore
from backups.models import RestoreStep
from backups.reader import MAX_DOCUMENT_BYTES, BackupInvalid, parse
from core.envconf import SettingError, env_secret
from core.errors import ServiceError
from nodes import audit


def _passphrase(path: str | None) -> str | None:
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise CommandError(f"--passphrase-file: cannot read {path!r}: {exc.strerror}") from None
    try:
        return env_secret("MIRBAD_RESTORE_PASSPHRASE")
    except SettingError as exc:
        raise CommandError(str(exc)) from None


class Command(BaseCommand):
    help = "Preview or restore a MirbadLLM backup, or rebuild an empty master from one."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="The backup document (JSON)")
        parser.add_argument("--passphrase-file", help="A file holding the backup's passphrase")
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--preview", action="store_true", help="Show what would change")
        mode.add_argument("--rebuild", action="store_true", help="Rebuild an empty master")
        parser.add_argument("--models", help="Comma-separated served names to restore")

    def handle(self, *args: Any, **options: Any) -> None:
        with audit.acting_as("manage.py restore", "local"):
            self._handle(**options)

    def _handle(self, **options: Any) -> None:
        path = Path(options["file"])
        try:
            size = path.stat().st_size
            if size > MAX_DOCUMENT_BYTES:
                raise CommandError(
                    f"{path}: {size} bytes; a backup is at most {MAX_DOCUMENT_BYTES}"
                )
            data = path.read_bytes()
        except OSError as exc:
            raise CommandError(f"{path}: {exc.strerror}") from None
        if options["rebuild"]:
            call_command("migrate", interactive=False, verbosity=0)
        try:
            backup = parse(data, passphrase=_passphrase(options["passphrase_file"]))
            if options["preview"]:
                result = restore.preview(backup)
            elif options["rebuild"]:
                result = restore.rebuild(backup, actor="manage.py restore")
            else:
                result = self._restore(data, options)
        except BackupInvalid as exc:
            raise CommandError(f"{path}: {exc}") from None
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(json.dumps(result, indent=2, default=str))

    def _restore(self, data: bytes, options: dict[str, Any]) -> dict[str, Any]:
        """Apply, then fetch the missing folders and start the auto-start models here."""
        names = options["models"]
        chosen = [n for n in names.split(",") if n] if names else None
        passphrase = _passphrase(options["passphrase_file"])
        actor = "manage.py restore"
        job = fleet_restore.upload(data, passphrase=passphrase, file_name=options["file"],
                                   actor=actor)  # fmt: skip
        job = fleet_restore.confirm(job, passphrase=passphrase, served_names=chosen, actor=actor,
                                    queue=False)  # fmt: skip
        fleet_restore.run(job.pk, job.applied.get("sources") or {})
        steps = [
            {"node": s.node_id, "model": s.served_name, "folder": s.folder, "step": s.phase,
             "note": s.note}
            for s in RestoreStep.objects.filter(job=job)
        ]  # fmt: skip
        return {"models": job.applied["models"], "apiKeysAdded": job.applied["apiKeysAdded"],
                "steps": steps}  # fmt: skip
