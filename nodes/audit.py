"""The audit log: what was done to the fleet, by whom, and when (nodes.models.AuditEvent).

Written in the caller's transaction, so an event exists exactly when what it records
was saved; also logged to ``mirbad.audit`` for the log files.
"""

from __future__ import annotations

import logging
from typing import Any

from nodes.models import AuditEvent

__all__ = ["record"]

log = logging.getLogger("mirbad.audit")


def record(action: str, *, actor: str = "system", node_id: str = "", subject: str = "",
           **detail: Any) -> AuditEvent:  # fmt: skip
    """Store one event (and log it)."""
    event = AuditEvent.objects.create(
        actor=actor[:150], action=action[:60], node_id=node_id[:40], subject=subject[:60],
        detail=detail,
    )  # fmt: skip
    log.info("%s %s node=%s %s %s", actor, action, node_id or "-", subject, detail or "")
    return event
