"""The protocol versions of docs/agent-api.md: the agent offers them in ``GET /info``, the
master's monitor accepts a node only when they share one (else Incompatible)."""

from __future__ import annotations

__all__ = ["PROTOCOL_VERSIONS"]

PROTOCOL_VERSIONS: tuple[int, ...] = (1,)
