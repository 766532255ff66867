"""Stopping the engines a dead agent left behind, from its own ``processes.json``.

Whoever supervises the agent (``./mirbad up``) calls this after the agent is
gone, so stopping the stack stops the engines too even when the agent was
killed and could not stop them itself. A process is stopped only when it is
provably one of the records, by the same proof adoption uses
(:func:`agent.engines.process._reconcile.matches_record`: pid, creation time, program, argv
digest), or, for a start whose pid was never recorded, by
:func:`agent.engines.process._reconcile.scan`'s pending rule. Anything else is left alone.
"""

from __future__ import annotations

import logging
import os

from agent._config import AgentConfig
from agent.engines.process._adoption import runtime_folders
from agent.engines.process._instance import READY, STARTING
from agent.engines.process._reconcile import (
    Observed,
    Pending,
    matches_record,
    observe,
    scan,
    stop_group,
)
from agent.engines.process._records import PROCESSES_FILE, read_records

__all__ = ["stop_recorded_engines"]

log = logging.getLogger("mirbad.agent.process")


def stop_recorded_engines(config: AgentConfig, *, grace: float = 10.0) -> list[int]:
    """Stop every live engine the agent of ``config`` recorded; returns their pids.

    Blocking (each stop waits up to ``grace`` s). Call it only once that agent is
    gone: a live agent would see its engines die under it.
    """
    records = read_records(
        config.state_directory / PROCESSES_FILE, unreadable="no engine is stopped from it"
    )
    folders = runtime_folders(config)
    if not records or not folders:
        return []
    targets: list[Observed] = []
    pending: list[Pending] = []
    for record in records:
        pid = record.get("pid")
        if record.get("pendingStart"):
            digest, since = record.get("argvDigest"), record.get("pendingSince")
            if isinstance(digest, str) and isinstance(since, int | float):
                pending.append(
                    Pending(instance_id=str(record.get("instanceId")), digest=digest, since=since)
                )
        elif record.get("state") in (STARTING, READY) and isinstance(pid, int) and pid > 0:
            obs = observe(pid, folders)
            if obs is not None and matches_record(obs, record):
                targets.append(obs)
    if pending:
        skip = {os.getpid(), *(obs.pid for obs in targets)}
        found = scan(folders=folders, pending=pending, ports={}, skip=skip)
        targets.extend(f.obs for f in found if f.instance_id is not None)
    stopped = [obs.pid for obs in targets if stop_group(obs, grace)]
    for pid in stopped:
        log.warning("Stopped engine pid %s that its agent left running", pid)
    return stopped
