"""The agent's operation log: what it was asked to do, written before it does it.

Every mutating request gets an operation id (``MirbadLLM-Operation-Id`` from
the master, or one the agent draws). The record is fsynced as ``open`` before
the mutation runs and closed with its answer afterwards, so:

- the same id sent again gets the recorded answer, not a second mutation
  (idempotent per id), or 409 while it is still running;
- after a restart, operations left open are closed from what the state files
  show: a launch whose instance exists succeeded, a stop whose instance is
  stopped or gone succeeded, anything else failed. Nothing is replayed.

The file is rewritten whole through ``write_atomic`` (docs/decisions.md D15), so a
kill mid-save leaves the previous log: the record being written is lost, and for a
``begin`` the mutation it announced never ran. Loading and reconciling are
idempotent: a second pass over the same files closes nothing more
(tests/agent/test_oplog_replay.py). A save that fails refuses a ``begin`` (503
state_unavailable, the mutation not run) but not a ``close``: the mutation has
happened, so its answer goes out and the record is persisted with the next save.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent._errors import Conflict, InvalidRequest, OperationUnknown, StateUnavailable
from protocol.atomic import AtomicWriteError, write_atomic

log = logging.getLogger("mirbad.agent.oplog")

OPERATION_HEADER = "MirbadLLM-Operation-Id"
FILE_NAME = "operations.json"
KEEP = 1000
_ID = re.compile(r"^[A-Za-z0-9._-]{8,80}$")


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


def describe_request(method: str, path: str) -> tuple[str, str | None]:
    """(kind, instance id) of a mutating request, for reconciliation after a restart."""
    parts = path.rstrip("/").split("/")
    if method == "POST" and path.rstrip("/") == "/agent/v1/instances":
        return "launch", None
    # Only /instances/... names an instance; /downloads/{folder} and
    # /model-folders/{folder} have the same shape but name a folder.
    if len(parts) < 5 or parts[3] != "instances":
        return "other", None
    if method == "POST" and len(parts) == 6 and parts[-1] == "stop":
        return "stop", parts[4]
    if method == "DELETE" and len(parts) == 5:
        return "delete", parts[4]
    return "other", None


REDACTED = "[redacted]"
# Keys whose values are secrets wherever they appear in a recorded JSON body.
_SECRET_KEYS = frozenset({"token"})


def _redact_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: (REDACTED if k in _SECRET_KEYS and v is not None else _redact_value(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact_value(v) for v in value]
    return value


def redact_body(body: bytes | None) -> str:
    """A body as the log keeps it: JSON with every ``token`` replaced, else the text.

    The operation log must never hold a Hugging Face token, whether a request or an
    answer carried it. A body that is not JSON is kept as text (answers are JSON).
    """
    text = (body or b"").decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text
    redacted = _redact_value(data)
    return text if redacted == data else json.dumps(redacted)


class OperationLog:
    def __init__(self, *, state_dir: Path) -> None:
        self.path = state_dir / FILE_NAME
        self._lock = asyncio.Lock()
        self.operations: dict[str, dict[str, Any]] = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise StateUnavailable(f"{self.path} is unreadable ({exc}); fix or remove it") from exc
        return {op["id"]: op for op in data.get("operations", []) if "id" in op}

    def _save(self) -> None:
        ops = sorted(self.operations.values(), key=lambda o: o["openedAt"])[-KEEP:]
        self.operations = {op["id"]: op for op in ops}
        try:
            write_atomic(self.path, json.dumps({"operations": ops}).encode(), mode=0o600)
        except AtomicWriteError as exc:
            raise StateUnavailable(str(exc)) from exc  # it names the file and the step
        except OSError as exc:
            raise StateUnavailable(f"cannot persist {self.path}: {exc}") from exc

    @staticmethod
    def operation_id(header: str | None) -> str:
        if header is None or header == "":
            return "agent-" + secrets.token_hex(12)
        if not _ID.match(header):
            raise InvalidRequest(
                f"{OPERATION_HEADER}: {header!r} must be 8-80 letters, digits, '.', '_' or '-'"
            )
        return header

    async def begin(
        self, op_id: str, *, method: str, path: str, instance_id: str | None
    ) -> dict[str, Any] | None:
        """Record the operation as open; returns the earlier answer for a repeated id."""
        async with self._lock:
            known = self.operations.get(op_id)
            if known is not None:
                if known["state"] == "open":
                    # The details tell a repeat of a running operation (which the master
                    # retries) from every other conflict.
                    raise Conflict(
                        f"operation {op_id} is still running",
                        details={"operationId": op_id, "operationState": "open"},
                    )
                if (known["method"], known["path"]) != (method, path):
                    raise Conflict(
                        f"operation id {op_id} was used for {known['method']} {known['path']}"
                    )
                return known
            kind, target = describe_request(method, path)
            self.operations[op_id] = {
                "id": op_id,
                "kind": kind,
                "method": method,
                "path": path,
                "instanceId": instance_id or target,
                "state": "open",
                "openedAt": _now(),
            }
            try:
                await asyncio.to_thread(self._save)
            except StateUnavailable:
                # Not recorded, so not run: a retry under this id must not find it open.
                del self.operations[op_id]
                raise
            return None

    async def close(self, op_id: str, *, status: int, body: bytes | None) -> None:
        async with self._lock:
            op = self.operations.get(op_id)
            if op is None:
                return
            op["state"] = "succeeded" if status < 400 else "failed"
            op["status"] = status
            op["body"] = redact_body(body)[:65536]
            op["closedAt"] = _now()
            try:
                await asyncio.to_thread(self._save)
            except StateUnavailable as exc:
                # The mutation ran: its answer stands (a repeat gets it from memory), and
                # the next save or a restart's reconcile records it.
                log.error("Operation %s is closed but not saved: %s", op_id, exc.message)

    def open_operations(self, limit: int = 50) -> list[dict[str, Any]]:
        """The operations not yet ended, oldest first (the heartbeat and /status carry
        them: the console lists one that stays open)."""
        ops = sorted(
            (op for op in self.operations.values() if op["state"] == "open"),
            key=lambda o: o["openedAt"],
        )
        return [
            {k: op.get(k) for k in ("id", "kind", "instanceId", "openedAt")} for op in ops[:limit]
        ]

    def answer(self, op_id: str) -> dict[str, Any]:
        """One recorded operation as ``GET /agent/v1/operations/{id}`` answers it (the body
        as recorded: redacted). 404 operation_unknown when there is no record: the request
        never arrived, or it is older than the last :data:`KEEP` ones."""
        op = self.operations.get(op_id)
        if op is None:
            oldest = min((o["openedAt"] for o in self.operations.values()), default=None)
            raise OperationUnknown(
                f"no operation {op_id!r} is recorded",
                details={
                    "operationId": op_id,
                    "oldestOpenedAt": oldest,
                    "held": len(self.operations),
                    "kept": KEEP,
                },
            )
        return {
            "id": op["id"],
            "kind": op.get("kind"),
            "method": op.get("method"),
            "path": op.get("path"),
            "instanceId": op.get("instanceId"),
            "state": op.get("state"),
            "status": op.get("status"),
            "openedAt": op.get("openedAt"),
            "closedAt": op.get("closedAt"),
            "body": op.get("body"),
        }

    def reconcile(self, instance_state: Callable[[str], str | None]) -> int:
        """Close operations a restart left open, from what the instance records show."""
        closed = 0
        for op in self.operations.values():
            if op["state"] != "open":
                continue
            state = instance_state(op["instanceId"]) if op.get("instanceId") else None
            if op["kind"] == "launch":
                took = state is not None
            elif op["kind"] in ("stop", "delete"):
                took = state in (None, "Stopped", "Failed")
            else:
                took = False
            op["state"] = "succeeded" if took else "failed"
            op["status"] = 200 if took else 500
            op["body"] = json.dumps(
                {"reconciled": True, "note": "closed after an agent restart; not replayed"}
            )
            op["closedAt"] = _now()
            closed += 1
            log.info(
                "Closed open operation %s (%s) as %s after a restart",
                op["id"],
                op["kind"],
                op["state"],
            )
        if closed:
            self._save()
        return closed
