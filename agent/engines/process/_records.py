"""``processes.json``: the process runtime's instance records on disk.

Written atomically after every change (protocol.atomic), read back by adoption after an
agent restart and by ``stop-engines`` after the agent is gone. The one reader and the
one writer of the file's shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent._errors import StateUnavailable
from protocol.atomic import write_atomic

__all__ = ["PROCESSES_FILE", "read_records", "write_records"]

log = logging.getLogger("mirbad.agent.process")

PROCESSES_FILE = "processes.json"
_VERSION = 1


def write_records(state_file: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace the file with ``records``; StateUnavailable naming the file when it fails."""
    body = {"version": _VERSION, "instances": list(records)}
    try:
        write_atomic(state_file, json.dumps(body, indent=1).encode(), mode=0o600)
    except OSError as exc:
        raise StateUnavailable(f"cannot write {state_file}: {exc.strerror or exc}") from None


def read_records(state_file: Path, *, unreadable: str) -> list[dict[str, Any]] | None:
    """The instance records of ``processes.json``; None when absent or unreadable.

    ``unreadable`` ends the error logged for a file that cannot be read (what the
    caller does instead).
    """
    try:
        data = json.loads(state_file.read_text(encoding="utf-8"))
        records = data["instances"]
        if not isinstance(records, list):
            raise TypeError("'instances' is not a list")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("Cannot read %s (%s); %s", state_file, exc, unreadable)
        return None
    return [r for r in records if isinstance(r, dict)]
