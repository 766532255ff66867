"""``containers.json``: the container instances of this agent, written atomically (0600,
it holds the engines' keys), read back at start for adoption."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent._errors import StateUnavailable
from agent.engines._spec import check_args, parse_launch_spec
from agent.engines.container._instance import ContainerInstance
from protocol.atomic import write_atomic
from protocol.states import InstanceState

__all__ = ["RECORDS_FILE", "instance_from_record", "read_records", "write_records"]

log = logging.getLogger("mirbad.agent.container")

RECORDS_FILE = "containers.json"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of the previous run; none when the file does not exist.

    An unreadable file stops the agent (503 state_unavailable): starting empty would
    orphan every engine it describes, and the next write would lose their keys.
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise StateUnavailable(f"{path} is unreadable ({exc}); fix or remove it") from exc
    items = data.get("instances") if isinstance(data, dict) else None
    return [r for r in items or [] if isinstance(r, dict)]


def instance_from_record(record: dict[str, Any], path: Path) -> ContainerInstance | None:
    """The instance a record describes; an active one comes back Starting (to adopt)."""
    try:
        spec = parse_launch_spec(record["spec"])
        alias = check_args(spec.args, engine=spec.runtime, delivery="container")
    except Exception as exc:  # a record this version cannot read is dropped, loudly
        log.error("Dropping an unreadable record in %s: %s", path, exc)
        return None
    inst = ContainerInstance(spec=spec, alias=alias, key=str(record.get("apiKey") or ""))
    inst.container_id = record.get("containerId")
    inst.port = record.get("port")
    inst.restart_count = int(record.get("restartCount") or 0)
    inst.started_at = record.get("startedAtEpoch")
    inst.exit_code = record.get("exitCode")
    inst.error = record.get("error")
    inst.log_tail = list(record.get("logTail") or [])
    state = str(record.get("state"))
    # Until Docker answers, an active record is an engine to adopt: Starting.
    active = (InstanceState.STARTING, InstanceState.READY)
    inst.state = InstanceState.STARTING if state in active else InstanceState(state)
    return inst


def write_records(path: Path, instances: Iterable[ContainerInstance]) -> None:
    """Replace the file with these instances' records (temp, fsync, rename, fsync dir)."""
    payload = {"instances": [i.to_record() for i in instances]}
    try:
        write_atomic(path, json.dumps(payload).encode(), mode=0o600)
    except OSError as exc:
        raise StateUnavailable(f"cannot persist {path}: {exc}") from exc
