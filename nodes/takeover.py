"""The explicit fencing takeover: this master's epoch above every reachable agent's.

Split from nodes/services.py; docs/operator-guide.md, "Fencing and takeover".
"""

from __future__ import annotations

import json
import logging

from django.utils import timezone

from core.errors import ServiceError
from nodes import audit, fencing
from nodes.models import Node
from nodes.services import config
from protocol.atomic import write_atomic

__all__ = ["takeover"]

log = logging.getLogger("mirbad.nodes")


def takeover() -> dict[str, object]:
    """Raise this master's epoch above every reachable agent's (an operator's explicit act).

    Used when a restored or copied data directory left this master behind the
    epoch the agents remember (stale_master). The operator must first make sure
    the previous master is stopped; the record is kept in DATA_PATH/takeover.json.
    """
    from nodes.agent_client import AgentClient, AgentError

    cfg = config()
    before = fencing.read_identity(cfg.data_path)
    seen: dict[str, object] = {}
    highest = before.epoch if before else 0
    for node in Node.objects.filter(approved=True, revoked=False).exclude(spki_pin=""):
        try:
            with AgentClient(node=node, timeout=10) as client:
                accepted = client.info().get("fencing") or {}
        except AgentError as exc:
            seen[node.node_id] = f"unreachable: {exc}"
            continue
        epoch = int(accepted.get("epoch", 0))
        seen[node.node_id] = epoch
        highest = max(highest, epoch)
    identity = fencing.begin_epoch(cfg.data_path, at_least=highest + 1)
    record: dict[str, object] = {
        "at": timezone.now().isoformat(),
        "previousEpoch": before.epoch if before else None,
        "epoch": identity.epoch,
        "nodes": seen,
    }
    log.warning(
        "Takeover: epoch %s -> %d (nodes: %s)", record["previousEpoch"], identity.epoch, seen
    )
    audit.record(
        "master.takeover", previousEpoch=record["previousEpoch"], epoch=identity.epoch,
        nodes=seen,
    )  # fmt: skip
    # The file last: the epoch has moved and the audit log has it whatever the disk does.
    try:
        write_atomic(
            cfg.data_path / "takeover.json", json.dumps(record, indent=2).encode(), parents=True
        )
    except OSError as exc:
        raise ServiceError(
            503, "state_unavailable",
            f"the takeover is done (epoch {identity.epoch}, in the audit log), but {exc}",
        ) from exc  # fmt: skip
    return record
