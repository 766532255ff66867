"""Master fencing on the agent (docs/agent-api.md, "Fencing").

Every mutating request carries ``MirbadLLM-Master: {instance}/{epoch}/{boot}``
and ``MirbadLLM-Request-Time``. The agent persists the highest triple it
accepted (``fencing.json``, fsynced before the mutation runs) and refuses:

- a lower epoch: 409 ``stale_master`` (an old master, e.g. a restored data dir);
- the same epoch from another instance or boot: 409 ``competing_master``;
- a request time more than 5 minutes off the agent's clock: 400 ``clock_skew``.

A higher epoch is accepted and becomes the new floor: a normal master restart
is simply a higher epoch.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._atomic import write_atomic
from agent._errors import ApiError, InvalidRequest, StateUnavailable

log = logging.getLogger("mirbad.agent.fencing")

MASTER_HEADER = "MirbadLLM-Master"
TIME_HEADER = "MirbadLLM-Request-Time"
MAX_SKEW_SECONDS = 300.0
FILE_NAME = "fencing.json"
_TRIPLE = re.compile(r"^([A-Za-z0-9-]{1,64})/(\d{1,18})/([A-Za-z0-9-]{1,64})$")


class StaleMaster(ApiError):
    code = "stale_master"
    status = 409


class CompetingMaster(ApiError):
    code = "competing_master"
    status = 409


class ClockSkew(ApiError):
    code = "clock_skew"
    status = 400


@dataclass(frozen=True)
class Triple:
    instance_id: str
    epoch: int
    boot_id: str

    def header(self) -> str:
        return f"{self.instance_id}/{self.epoch}/{self.boot_id}"

    def to_json(self) -> dict[str, Any]:
        return {"instanceId": self.instance_id, "epoch": self.epoch, "bootId": self.boot_id}


def parse_triple(value: str | None) -> Triple:
    if not value:
        raise InvalidRequest(
            f"{MASTER_HEADER} is required on mutating requests ({{instance}}/{{epoch}}/{{boot}})"
        )
    match = _TRIPLE.match(value.strip())
    if match is None:
        raise InvalidRequest(f"{MASTER_HEADER}: {value!r} is not {{instance}}/{{epoch}}/{{boot}}")
    return Triple(match.group(1), int(match.group(2)), match.group(3))


def parse_time(value: str | None) -> dt.datetime:
    if not value:
        raise InvalidRequest(f"{TIME_HEADER} is required on mutating requests (ISO 8601, UTC)")
    try:
        moment = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{TIME_HEADER}: {value!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise InvalidRequest(f"{TIME_HEADER}: {value!r} has no time zone")
    return moment


class Fencing:
    """The highest accepted triple, persisted in the state directory."""

    def __init__(self, *, state_dir: Path) -> None:
        self.path = state_dir / FILE_NAME
        self._lock = asyncio.Lock()
        self.accepted: Triple | None = self._load()

    def _load(self) -> Triple | None:
        try:
            data = json.loads(self.path.read_text())
            return Triple(str(data["instanceId"]), int(data["epoch"]), str(data["bootId"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Refuse to guess a floor: an unreadable file must not let an old master in.
            raise StateUnavailable(f"{self.path} is unreadable ({exc}); fix or remove it") from exc

    def to_json(self) -> dict[str, Any] | None:
        return self.accepted.to_json() if self.accepted else None

    async def check(self, master: str | None, request_time: str | None) -> bool:
        """Accept or refuse one mutating request; True when the floor moved up."""
        triple = parse_triple(master)
        moment = parse_time(request_time)
        skew = (moment - dt.datetime.now(dt.UTC)).total_seconds()
        if abs(skew) > MAX_SKEW_SECONDS:
            raise ClockSkew(
                f"the request time is {skew:+.0f} s off the agent's clock (limit "
                f"{MAX_SKEW_SECONDS:.0f} s); fix the clocks (NTP)"
            )
        async with self._lock:
            current = self.accepted
            if current is not None:
                if triple.epoch < current.epoch:
                    raise StaleMaster(
                        f"epoch {triple.epoch} is below the accepted epoch {current.epoch} "
                        f"(master {current.instance_id}); this master is stale"
                    )
                if triple.epoch == current.epoch and triple != current:
                    raise CompetingMaster(
                        f"epoch {triple.epoch} is already held by master "
                        f"{current.instance_id} boot {current.boot_id}"
                    )
                if triple == current:
                    return False
            try:
                write_atomic(self.path, json.dumps(triple.to_json()).encode(), mode=0o600)
            except OSError as exc:
                raise StateUnavailable(f"cannot persist {self.path}: {exc}") from exc
            self.accepted = triple
            log.info("Accepted master %s", triple.header())
            return True
