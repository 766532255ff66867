"""Instance states as the agent reports them (docs/agent-api.md, "Instances").

The agent writes them into ``/status``, its events and ``processes.json``; the master's
monitor, model states, router and launcher read them. One definition, so a renamed
state cannot be read on one side only.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ACTIVE", "InstanceState"]


class InstanceState(StrEnum):
    STARTING = "Starting"
    READY = "Ready"
    FAILED = "Failed"
    STOPPED = "Stopped"


# An instance that holds (or is about to hold) its engine and memory.
ACTIVE: tuple[InstanceState, ...] = (InstanceState.STARTING, InstanceState.READY)
