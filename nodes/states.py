"""Node states, computed in one place (docs/operator-guide.md, "Node states")."""

from __future__ import annotations

from enum import StrEnum

OFFLINE_AFTER_SECONDS = 15.0


class NodeState(StrEnum):
    PENDING_APPROVAL = "PendingApproval"
    ONLINE = "Online"
    DEGRADED = "Degraded"
    INCOMPATIBLE = "Incompatible"
    OFFLINE = "Offline"
    PENDING_TAKEOVER = "PendingTakeover"
    REVOKED = "Revoked"
    # Not a state of the node: Redis is unreachable and this process never read its
    # status (nodes.status_cache). compute_state never returns it.
    UNKNOWN = "Unknown"


SERVING = frozenset({NodeState.ONLINE, NodeState.DEGRADED})


def compute_state(
    *,
    approved: bool,
    revoked: bool,
    enrolled: bool,
    connected: bool,
    seconds_since_contact: float | None,
    incompatible: bool,
    pending_takeover: bool = False,
    reasons: list[dict[str, str]] | None = None,
) -> NodeState:
    """The one function that turns what the master knows into a state."""
    if revoked:
        return NodeState.REVOKED
    if not approved:
        return NodeState.PENDING_APPROVAL
    if not enrolled or not connected or seconds_since_contact is None:
        return NodeState.OFFLINE
    if seconds_since_contact > OFFLINE_AFTER_SECONDS:
        return NodeState.OFFLINE
    if incompatible:
        return NodeState.INCOMPATIBLE
    if pending_takeover:
        return NodeState.PENDING_TAKEOVER
    if reasons:
        return NodeState.DEGRADED
    return NodeState.ONLINE


def registry_state(*, approved: bool, revoked: bool) -> NodeState | None:
    """The state the registry alone decides; None means the live status cache decides."""
    if revoked:
        return NodeState.REVOKED
    if not approved:
        return NodeState.PENDING_APPROVAL
    return None
