"""A node's effective status: the one rule every reader applies.

The monitor writes what it learned about a node to the status cache (it is the
only writer). What a node *is* for the rest of the master also depends on the
registry and on time, so every reader (``/api``, the console, the router, model
commands and their refusals, the launcher) goes through :func:`effective`:

1. the registry decides first: a revoked node is Revoked, one not approved yet
   is PendingApproval, whatever the cache holds (docs/operator-guide.md, "Node
   states");
2. otherwise the cached record's state, with no record meaning Offline;
3. a serving state whose ``lastSeen`` is more than 15 s old is Offline: a dead
   monitor writes nothing, and must not leave a node Online (docs/decisions.md
   D8). A last-known copy (Redis unreachable, docs/decisions.md D37) is judged
   as of when it was read, so /v1 keeps serving through a Redis stall;
4. the maintenance hold is carried beside the state (``maintenanceLeft``,
   seconds): a held node keeps its state and takes model commands, but /v1 sends
   it no traffic (docs/decisions.md D30).

:func:`is_serving` says whether an effective status is Online or Degraded;
:func:`require_serving` is the refusal model commands give otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

from core.errors import ServiceError
from nodes import status_cache
from nodes.states import OFFLINE_AFTER_SECONDS, SERVING, NodeState, registry_state
from nodes.status_cache import NodeStatus


class Registered(Protocol):
    """What the rule needs of a registry row (``nodes.models.Node``)."""

    node_id: str
    approved: bool
    revoked: bool

    def maintenance_left(self) -> float: ...


def live_state(record: NodeStatus, now: float | None = None) -> str:
    """The cached record's state after the 15 s rule (no registry)."""
    state = record.get("state", NodeState.OFFLINE.value)
    if state not in SERVING:
        return state
    if status_cache.source(record) == status_cache.LAST_KNOWN:
        # Judged as of the read that produced it: Redis stalling says nothing of the node.
        moment = record.get("statusAsOf")
    else:
        moment = time.time() if now is None else now
    last = record.get("lastSeen")
    if last is None or moment is None or moment - last > OFFLINE_AFTER_SECONDS:
        return NodeState.OFFLINE.value
    return state


def effective(node: Registered, record: NodeStatus | None, now: float | None = None) -> NodeStatus:
    """The node's status as every reader shows and uses it (a copy; ``record`` is not changed)."""
    status: NodeStatus = (
        record.copy()
        if record is not None
        else {
            "nodeId": node.node_id,
            "state": NodeState.OFFLINE.value,
            "reasons": [],
            "lastSeen": None,
        }
    )
    fixed = registry_state(approved=node.approved, revoked=node.revoked)
    status["state"] = fixed.value if fixed is not None else live_state(status, now)
    status["maintenanceLeft"] = node.maintenance_left()
    return status


def is_serving(status: NodeStatus | None) -> bool:
    """Online or Degraded: the node can run model commands (and, unless held, take /v1)."""
    return status is not None and status.get("state") in SERVING


def takes_traffic(status: NodeStatus) -> bool:
    """Serving and not held for maintenance: /v1 may send its replicas requests."""
    return is_serving(status) and not status.get("maintenanceLeft")


def state_of(status: NodeStatus | None) -> str:
    return (status or {}).get("state", NodeState.OFFLINE.value)


def read(node: Registered) -> NodeStatus:
    """One node's effective status (the status cache read as :func:`read_many`)."""
    return effective(node, status_cache.read(node.node_id))


async def aread(node: Registered) -> NodeStatus:
    """:func:`read` for the event loop."""
    return effective(node, await status_cache.aread(node.node_id))


def read_many(nodes: Iterable[Registered]) -> dict[str, NodeStatus]:
    """Each node's effective status by node id; one Redis round trip.

    Redis unreachable: the last known records, marked (``nodes.status_cache``).
    """
    by_id = {node.node_id: node for node in nodes}
    records = status_cache.read_many(sorted(by_id))
    now = time.time()  # one clock for the list: a thousand nodes are judged at one moment
    return {node_id: effective(node, records.get(node_id), now) for node_id, node in by_id.items()}


def require_serving(node: Registered, consequence: str) -> NodeStatus:
    """The node's effective status, or 503 node_not_serving naming its state and ``consequence``."""
    status = read(node)
    if not is_serving(status):
        raise ServiceError(
            503,
            "node_not_serving",
            f"Node {node.node_id} is not serving (state: {state_of(status)}); {consequence}.",
        )
    return status
