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
import contextlib
import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

from agent._errors import ApiError, InvalidRequest, StateUnavailable
from protocol import fencing
from protocol.atomic import AtomicWriteError, write_atomic
from protocol.errors import AgentCode
from protocol.fencing import MAX_SKEW_SECONDS, Triple

log = logging.getLogger("mirbad.agent.fencing")

FILE_NAME = "fencing.json"


class StaleMaster(ApiError):
    code = AgentCode.STALE_MASTER
    status = 409


class CompetingMaster(ApiError):
    code = AgentCode.COMPETING_MASTER
    status = 409


class ClockSkew(ApiError):
    code = AgentCode.CLOCK_SKEW
    status = 400


def parse_triple(value: str | None) -> Triple:
    try:
        return fencing.parse_triple(value)
    except fencing.FencingHeaderError as exc:
        raise InvalidRequest(str(exc)) from None


def parse_time(value: str | None) -> dt.datetime:
    try:
        return fencing.parse_time(value)
    except fencing.FencingHeaderError as exc:
        raise InvalidRequest(str(exc)) from None


class Fencing:
    """The highest accepted triple, persisted in the state directory."""

    def __init__(self, *, state_dir: Path) -> None:
        self.path = state_dir / FILE_NAME
        self._lock = asyncio.Lock()
        self.accepted: Triple | None = self._load()

    def _load(self) -> Triple | None:
        try:
            data = json.loads(self.path.read_text())
            return Triple.from_json(data)
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
            judged = fencing.verdict(current, triple)
            if judged == "same":
                return False
            if current is not None and judged == "stale":
                raise StaleMaster(
                    f"epoch {triple.epoch} is below the accepted epoch {current.epoch} "
                    f"(master {current.instance_id}); this master is stale"
                )
            if current is not None and judged == "competing":
                raise CompetingMaster(
                    f"epoch {triple.epoch} is already held by master "
                    f"{current.instance_id} boot {current.boot_id}"
                )
            try:
                write_atomic(self.path, json.dumps(triple.to_json()).encode(), mode=0o600)
            except AtomicWriteError as exc:
                # The floor follows the file: after the rename (a failed directory fsync)
                # it holds the new triple, which a restart would read.
                with contextlib.suppress(StateUnavailable):
                    self.accepted = self._load()
                raise StateUnavailable(str(exc)) from exc  # it names the file and the step
            except OSError as exc:
                raise StateUnavailable(f"cannot persist {self.path}: {exc}") from exc
            self.accepted = triple
            log.info("Accepted master %s", triple.header())
            return True
