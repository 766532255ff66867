"""The master's operation log: every mutation it sends to an agent, recorded first.

The agent keeps its own log (docs/agent-api.md, "Operation log"): a repeated
``MirbadLLM-Operation-Id`` is answered from the record, never acted on twice. This
module is the master's half (docs/decisions.md D75-D78):

- :func:`send` writes a :class:`~nodes.models.MasterOperation` in its own committed
  transaction *before* the request leaves, so a crash or a lost answer can never hide
  that something was asked. It sends the request with the operation's id, and closes
  the row with the answer.
- An answer lost on the way (the connection cut, a read timeout, a connect error) is
  sent again under the *same* id, a bounded number of times with a short back-off; the
  agent answers a repeat from its log, or 409 while the first is still running, which
  is waited out the same way. No answer at all: the row stays ``open`` and the caller
  gets the client's error (AgentTimeout or AgentUnreachable), as before.
- :func:`reconcile` (the monitor, when it reaches a node) closes the node's open rows
  from the agent's record (``GET /agent/v1/operations/{id}``): the agent's outcome,
  or ``failed`` "never reached the agent" when it has no record. One still running on
  the agent stays open. The rows live in the shared database, so a standby monitor
  that takes over closes what another process opened.

Summaries are short and redacted: a download's body may carry a Hugging Face token,
and no answer or error text is stored without passing :func:`redact` first.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import ssl
import time
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

import httpx
from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from core.errors import ServiceError
from nodes.agent_client import AgentRefused, AgentTimeout, AgentUnreachable
from nodes.models import MasterOperation, Node
from protocol.errors import AgentCode

if TYPE_CHECKING:
    from nodes.agent_client import AgentClient, AsyncAgentClient

__all__ = [
    "ATTEMPTS",
    "OPERATION_HEADER",
    "Kind",
    "open_for",
    "page",
    "reconcile",
    "redact",
    "send",
    "stuck",
]

log = logging.getLogger("mirbad.operations")

OPERATION_HEADER = "MirbadLLM-Operation-Id"
REPEATED_HEADER = "MirbadLLM-Operation-Repeated"
Kind = MasterOperation.Kind
State = MasterOperation.State

# Three tries over about two seconds: enough for a connection cut or an agent that is
# restarting its listener, short enough for a console action the operator waits on.
ATTEMPTS = 3
BACKOFF = (0.5, 1.5)  # before the second and third attempt (tests set zeros)
# The rotation's steps are sent once: the rotation id makes each idempotent and its own
# stage machine reads back what a lost answer did (nodes/rotation.py, D55); the commit
# must travel over a fresh proof connection, which a quick retry would not be.
ONCE = frozenset({Kind.ROTATION_START, Kind.ROTATION_INSTALL, Kind.ROTATION_COMMIT,
                  Kind.ROTATION_ABORT})  # fmt: skip
SUMMARY_CHARS = 500
# The monitor asks about this many of a node's open rows per pass, oldest first.
RECONCILE_LIMIT = 50
REDACTED = "[redacted]"
_SECRET_KEYS = frozenset({"token", "key", "apikey", "password", "secret", "authorization"})
# A token that slipped into free text (an error message quoting a URL or a header).
_SECRET_TEXT = re.compile(r"\bhf_[A-Za-z0-9]{6,}|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{6,}")
# Fields of an answer worth keeping in its one-line summary.
_SUMMARY_KEYS = ("instanceId", "folder", "rotationId", "state", "stage", "error", "exitCode")


def new_id() -> str:
    """A fresh operation id: "m-" and 32 hex digits (the agent takes 8-80 of ``A-Za-z0-9._-``)."""
    return "m-" + uuid.uuid4().hex


# -- redaction and summaries -------------------------------------------------------------


def redact(value: Any) -> Any:
    """``value`` with every secret-named key's value and every token-looking text replaced."""
    if isinstance(value, dict):
        return {
            k: REDACTED if str(k).lower() in _SECRET_KEYS and v is not None else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _SECRET_TEXT.sub(REDACTED, value)
    return value


def _short(text: str) -> str:
    text = _SECRET_TEXT.sub(REDACTED, text)
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def summarize(answer: Any) -> str:
    """An answer as one short, redacted line: its identifying fields, or its text."""
    if answer is None:
        return ""
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and "code" in error:
            return _short(f"{error.get('code')}: {redact(error.get('message', ''))}")
        picked = {k: answer[k] for k in _SUMMARY_KEYS if answer.get(k) not in (None, "", [])}
        return _short(json.dumps(redact(picked or answer), separators=(",", ":"), default=str))
    return _short(json.dumps(redact(answer), default=str))


def _body_summary(body: Any) -> str:
    """The agent's recorded answer body (a JSON text, redacted there already) as a summary."""
    if not body:
        return ""
    try:
        return summarize(json.loads(body))
    except (TypeError, ValueError):
        return _short(str(body))


# -- recording ---------------------------------------------------------------------------


def _wait_of(timeout: float) -> dt.timedelta:
    """How long one attempt may keep its sender waiting: httpx's timeout applies to each of
    connect, write and read in turn, and the next back-off follows."""
    return dt.timedelta(seconds=3 * timeout + max(BACKOFF, default=0.0) + 1.0)


def record(node: Node, *, kind: str, method: str, path: str, target: str) -> MasterOperation:
    """Write the operation as open, committed in its own transaction, before it is sent.

    A caller inside a transaction of its own (the model editor saves a definition and
    starts its download as one unit, so a refused download saves nothing) gets the row
    in that transaction: it commits with the caller's work, and vanishes with it only
    when the caller rolls back because the agent refused, which the agent's own log
    then shows as a failed operation (docs/decisions.md D75).
    """
    fields = {"operation_id": new_id(), "node": node, "kind": kind, "method": method,
              "path": path[:300], "target": target[:200]}  # fmt: skip
    if transaction.get_connection().in_atomic_block:
        try:
            with transaction.atomic(durable=True):  # allowed inside a test's own atomic block
                return MasterOperation.objects.create(**fields)
        except RuntimeError:  # nested in the caller's transaction: see above
            return MasterOperation.objects.create(**fields)
    with transaction.atomic(durable=True):
        return MasterOperation.objects.create(**fields)


def _attempt(op: MasterOperation, timeout: float) -> None:
    op.attempts += 1
    op.sender_deadline = timezone.now() + _wait_of(timeout)
    MasterOperation.objects.filter(pk=op.pk).update(
        attempts=op.attempts, sender_deadline=op.sender_deadline
    )


def _close(
    op: MasterOperation, *, state: str, status: int | None, summary: str, reconciled: bool = False
) -> None:
    """The answer (or, with ``reconciled``, the agent's record) closes the row."""
    now = timezone.now()
    fields = {"state": state, "status_code": status, "summary": _short(summary),
              "closed_at": now, "reconciled": reconciled, "sender_deadline": now}  # fmt: skip
    rows = MasterOperation.objects.filter(pk=op.pk)
    if reconciled:
        rows = rows.filter(state=State.OPEN)  # an answer that arrived meanwhile wins
    rows.update(**fields)
    for name, value in fields.items():
        setattr(op, name, value)


def _give_up(op: MasterOperation, error: Exception) -> None:
    """No answer ever came: the row stays open, the monitor closes it from the agent."""
    op.sender_deadline = timezone.now()
    op.summary = _short(f"no answer after {op.attempts} attempt(s): {error}")
    MasterOperation.objects.filter(pk=op.pk, state=State.OPEN).update(
        sender_deadline=op.sender_deadline, summary=op.summary
    )
    log.warning("Operation %s (%s %s on node %s) left open: %s", op.operation_id, op.kind,
                op.target, op.node.node_id, op.summary)  # fmt: skip


def _still_running(exc: AgentRefused, op_id: str) -> bool:
    """The agent's 409 for a repeat of an operation it has not finished (not any conflict)."""
    return (
        exc.status == 409
        and exc.details.get("operationId") == op_id
        and exc.details.get("operationState") == "open"
    )


def _certificate_refused(exc: Exception) -> bool:
    """A refused certificate stays refused: another try cannot help."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


# -- sending -----------------------------------------------------------------------------


def send(
    client: AgentClient,
    *,
    kind: str,
    method: str,
    path: str,
    target: str = "",
    via: httpx.Client | None = None,
    attempts: int | None = None,
    **kwargs: Any,
) -> Any:
    """Record, send with the operation's id, close with the answer; answers its JSON.

    A lost answer is sent again under the same id (:data:`ATTEMPTS`, or once for the
    rotation's steps); the last transport error is raised when none ever came, the row
    left open. An error the agent answered closes the row ``failed`` and is raised.
    ``via`` sends over another client (the rotation's proof connection).
    """
    client.fencing_headers()  # refuses (monitor_not_started) before anything is recorded
    tries = attempts if attempts is not None else (1 if kind in ONCE else ATTEMPTS)
    op = record(client.node, kind=kind, method=method, path=path, target=target)
    lost: AgentUnreachable | None = None
    for number in range(tries):
        if number:
            time.sleep(BACKOFF[min(number, len(BACKOFF)) - 1] if BACKOFF else 0.0)
        _attempt(op, client.timeout)
        headers = {**client.fencing_headers(), OPERATION_HEADER: op.operation_id}
        seen: list[httpx.Response] = []
        try:
            if via is None:
                answer = client._request(method, path, headers=headers, responses=seen, **kwargs)
            else:
                answer = client.request_via(via, method, path, headers=headers, responses=seen,
                                            **kwargs)  # fmt: skip
        except AgentRefused as exc:
            if _still_running(exc, op.operation_id):
                # The first try is still running on the agent: its answer will be recorded.
                lost = lost or AgentTimeout(
                    f"node {client.node.node_id}: operation {op.operation_id} is still "
                    f"running on the agent; the outcome is unknown"
                )
                continue
            _close(op, state=State.FAILED, status=exc.status,
                   summary=f"{exc.code}: {redact(exc.message)}")  # fmt: skip
            raise
        except AgentUnreachable as exc:
            lost = exc
            if _certificate_refused(exc):
                break
            log.info("Operation %s (%s %s on node %s): attempt %d got no answer: %s",
                     op.operation_id, kind, target, client.node.node_id, op.attempts, exc)  # fmt: skip
            continue
        status = seen[-1].status_code if seen else None
        repeated = bool(seen) and seen[-1].headers.get(REPEATED_HEADER) == "true"
        summary = summarize(answer)
        if repeated:
            summary = _short(f"(answered from the agent's log) {summary}")
        _close(op, state=State.SUCCEEDED, status=status, summary=summary)
        return answer
    assert lost is not None  # every try ended in `continue` or `break` with `lost` set
    _give_up(op, lost)
    raise lost


# -- reading -----------------------------------------------------------------------------


def open_for(node: Node, limit: int = 50) -> list[MasterOperation]:
    """The node's open operations, oldest first (the node page; one query)."""
    return list(
        MasterOperation.objects.filter(node=node, state=State.OPEN).order_by("opened_at")[:limit]
    )


PAGE_DEFAULT = 50
PAGE_MAX = 200


def page(
    node_id: str, *, state: str | None, limit: str | None
) -> tuple[list[MasterOperation], bool]:
    """``GET /api/nodes/{id}/operations``: the node's operations, newest first, at most
    ``limit`` (1-200, 50 by default), ``state`` one of open, succeeded, failed; answers the
    page and whether more are left out."""
    node = Node.objects.filter(node_id=node_id).first()
    if node is None:
        raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
    rows = MasterOperation.objects.filter(node=node)
    if state not in (None, ""):
        if state not in State.values:
            raise ServiceError(400, "invalid_request",
                               f"state: one of {', '.join(State.values)}; not {state[:40]!r}",
                               details={"field": "state"})  # fmt: skip
        rows = rows.filter(state=state)
    size = PAGE_DEFAULT
    if limit not in (None, ""):
        try:
            size = int(limit)
        except ValueError:
            size = 0
        if not 1 <= size <= PAGE_MAX:
            raise ServiceError(400, "invalid_request",
                               f"limit: a whole number from 1 to {PAGE_MAX}",
                               details={"field": "limit"})  # fmt: skip
    found = list(rows.order_by("-opened_at", "-id")[: size + 1])
    return found[:size], len(found) > size


def stuck(older_than: float, *, now: dt.datetime | None = None, limit: int = 50) -> list[
    MasterOperation
]:  # fmt: skip
    """Open operations of every node opened ``older_than`` seconds ago or earlier, oldest
    first, their nodes joined (the Overview's Needs attention; one query)."""
    moment = now or timezone.now()
    return list(
        MasterOperation.objects.filter(
            state=State.OPEN, opened_at__lte=moment - dt.timedelta(seconds=older_than)
        )
        .select_related("node")
        .order_by("opened_at")[:limit]
    )


# -- reconciliation (the monitor) --------------------------------------------------------


def due(node_pk: int, *, now: dt.datetime | None = None) -> list[MasterOperation]:
    """The node's open operations no sender waits on any more, oldest first."""
    moment = now or timezone.now()
    return list(
        MasterOperation.objects.filter(node_id=node_pk, state=State.OPEN)
        .filter(sender_deadline__lte=moment)
        .select_related("node")
        .order_by("opened_at")[:RECONCILE_LIMIT]
    )


def due_nodes(*, now: dt.datetime | None = None) -> set[str]:
    """The nodes with an open operation no sender waits on any more (one query: the
    monitor asks every 30 s for the whole fleet, not once per node)."""
    moment = now or timezone.now()
    return set(
        MasterOperation.objects.filter(state=State.OPEN, sender_deadline__lte=moment)
        .values_list("node__node_id", flat=True)
        .distinct()
    )


def _parse_time(value: Any) -> dt.datetime | None:
    try:
        moment = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else None


def close_unknown(op: MasterOperation, details: dict[str, Any]) -> str:
    """The agent has no record of the operation: it never arrived, unless the agent has
    pruned records as old as this one (it keeps its last 1000)."""
    oldest = _parse_time(details.get("oldestOpenedAt"))
    kept, held = details.get("kept"), details.get("held")
    full = isinstance(kept, int) and isinstance(held, int) and held >= kept
    if full and oldest is not None and op.opened_at < oldest:
        summary = (f"outcome unknown: the agent keeps only its last {details['kept']} "
                   "operations and no longer has this one")  # fmt: skip
    else:
        summary = "never reached the agent (it has no record of the operation)"
    _close(op, state=State.FAILED, status=None, summary=summary, reconciled=True)
    return summary


def close_from_record(op: MasterOperation, agent: dict[str, Any]) -> str:
    """Close ``op`` with the outcome the agent recorded for it; answers the state."""
    state = State.SUCCEEDED if agent.get("state") == "succeeded" else State.FAILED
    status = agent.get("status")
    _close(op, state=state, status=status if isinstance(status, int) else None,
           summary=_body_summary(agent.get("body")), reconciled=True)  # fmt: skip
    return state


async def reconcile(
    node: Node, client: AsyncAgentClient, *, now: dt.datetime | None = None
) -> dict[str, int]:
    """Close ``node``'s open operations from what its agent recorded; answers the counts
    (``succeeded``, ``failed``, ``never_reached``, ``still_open``, ``skipped``).

    Called by the monitor after ``/status`` on every (re)connect, and every
    :data:`nodes.monitor.RECONCILE_INTERVAL` for the nodes :func:`due_nodes` names. The ORM runs in sync_to_async's thread, the
    agent is asked over the monitor's own async client. An agent that cannot be reached
    raises AgentUnreachable (the monitor's connection is lost anyway); any other refusal
    leaves the row open for a later pass.
    """
    counts: Counter[str] = Counter()
    for op in await sync_to_async(due)(node.pk, now=now):
        try:
            agent = await client.operation(op.operation_id)
        except AgentRefused as exc:
            if exc.code == AgentCode.OPERATION_UNKNOWN:
                await sync_to_async(close_unknown)(op, exc.details)
                counts["never_reached"] += 1
                continue
            # An agent older than the endpoint answers a plain 404: nothing to learn.
            counts["skipped"] += 1
            log.info("Node %s: cannot reconcile operation %s: %s", node.node_id,
                     op.operation_id, exc)  # fmt: skip
            if exc.status == 404:
                break
            continue
        if agent.get("state") not in ("succeeded", "failed"):
            counts["still_open"] += 1  # still running on the agent: its answer will come
            continue
        counts[str(await sync_to_async(close_from_record)(op, agent))] += 1
    if counts:
        log.info("Node %s: reconciled open operations: %s", node.node_id, dict(counts))
    return dict(counts)
