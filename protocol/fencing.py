"""The fencing triple both sides read the same way (docs/agent-api.md, "Fencing").

Every mutating request to an agent carries ``MirbadLLM-Master: {instance}/{epoch}/{boot}``
and ``MirbadLLM-Request-Time``. The agent keeps the highest triple it accepted as a
floor; :func:`verdict` is the one rule that says what a request's triple is against
that floor, used by the agent to refuse and by the master to tell that an agent has
accepted a master this one cannot overrule (PendingTakeover).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "MASTER_HEADER",
    "MAX_SKEW_SECONDS",
    "TIME_HEADER",
    "FencingHeaderError",
    "Triple",
    "Verdict",
    "parse_time",
    "parse_triple",
    "verdict",
]

MASTER_HEADER = "MirbadLLM-Master"
TIME_HEADER = "MirbadLLM-Request-Time"
MAX_SKEW_SECONDS = 300.0
_TRIPLE = re.compile(r"([A-Za-z0-9-]{1,64})/(\d{1,18})/([A-Za-z0-9-]{1,64})")

Verdict = Literal["higher", "same", "stale", "competing"]


class FencingHeaderError(ValueError):
    """A fencing header is missing or malformed; the message names the header."""


@dataclass(frozen=True)
class Triple:
    """One master start: its instance id, the epoch it raised, and its boot id."""

    instance_id: str
    epoch: int
    boot_id: str

    def header(self) -> str:
        return f"{self.instance_id}/{self.epoch}/{self.boot_id}"

    def to_json(self) -> dict[str, Any]:
        return {"instanceId": self.instance_id, "epoch": self.epoch, "bootId": self.boot_id}

    @classmethod
    def from_json(cls, data: Any) -> Triple:
        """From ``to_json``'s shape; KeyError, TypeError or ValueError when it is not that."""
        return cls(str(data["instanceId"]), int(data["epoch"]), str(data["bootId"]))


def parse_triple(value: str | None) -> Triple:
    if not value:
        raise FencingHeaderError(
            f"{MASTER_HEADER} is required on mutating requests ({{instance}}/{{epoch}}/{{boot}})"
        )
    match = _TRIPLE.fullmatch(value.strip())
    if match is None:
        raise FencingHeaderError(
            f"{MASTER_HEADER}: {value!r} is not {{instance}}/{{epoch}}/{{boot}}"
        )
    return Triple(match.group(1), int(match.group(2)), match.group(3))


def parse_time(value: str | None) -> dt.datetime:
    if not value:
        raise FencingHeaderError(f"{TIME_HEADER} is required on mutating requests (ISO 8601, UTC)")
    try:
        moment = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise FencingHeaderError(f"{TIME_HEADER}: {value!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise FencingHeaderError(f"{TIME_HEADER}: {value!r} has no time zone")
    return moment


def verdict(floor: Triple | None, incoming: Triple) -> Verdict:
    """What ``incoming`` is against the highest accepted triple ``floor``.

    ``stale``: a lower epoch (an old master, e.g. a restored data directory);
    ``competing``: the same epoch from another instance or boot; ``same``: the floor
    itself; ``higher``: a new floor (a normal master restart is a higher epoch).
    """
    if floor is None or incoming.epoch > floor.epoch:
        return "higher"
    if incoming.epoch < floor.epoch:
        return "stale"
    return "same" if incoming == floor else "competing"
