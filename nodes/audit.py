"""The audit log: what was done to the fleet, by whom, from where, and when.

Every event is a ``nodes.models.AuditEvent`` row, written in the caller's transaction
(so it exists exactly when what it records was saved), and a line on the
``mirbad.audit`` logger. The recorded actions and their names are listed in
docs/operator-guide.md, "Audit log".

*Who* and *from where* are not passed down through every service: the web request
being served is bound to the context by :class:`AuditContextMiddleware`, and
:func:`record` reads the console user or the API key (by its public prefix) and the
peer address from it when the event is written. Work that runs outside a request
(management commands, Celery tasks, the monitor) names itself with :func:`acting_as`;
without either the actor is ``system``.

Secrets never reach a row or the log: :func:`mask` replaces the value of every detail
whose name says it holds one (token, secret, password, ...) and every string that
carries an API key, before anything is stored.
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import datetime as dt
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseBase
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from core.errors import ServiceError
from nodes.models import AuditEvent

__all__ = [
    "CSV_COLUMNS",
    "PAGE_SIZE",
    "AuditContextMiddleware",
    "AuditFilter",
    "Origin",
    "acsv_lines",
    "acting_as",
    "csv_lines",
    "csv_text",
    "current_origin",
    "mask",
    "page",
    "parse_filter",
    "prune",
    "record",
    "select",
]

log = logging.getLogger("mirbad.audit")

MASK = "********"
# Detail names whose values are secrets, matched anywhere in the name and in any case:
# ``hfToken``, ``join_token``, ``passphrase``, ``Authorization``, ``apiKey``... A key's
# public prefix is kept (it is named ``prefix`` or ``keyPrefix``, never ``key``).
_SECRET_NAME = re.compile(r"token|secret|passw|passphrase|credential|authoriz|api_?key|private",
                          re.IGNORECASE)  # fmt: skip
# An API key inside free text (an error message, a copied command): ``mbd-`` and its body.
_API_KEY_TEXT = re.compile(r"\bmbd-[A-Za-z0-9_-]{8,}")
# A bearer credential inside free text.
_BEARER_TEXT = re.compile(r"(?i)\bbearer\s+\S+")

CSV_COLUMNS = ("at", "actor", "source", "action", "node_id", "subject", "detail")


@dataclass(frozen=True, slots=True)
class Origin:
    """Who acts and from where, for work that is not a web request."""

    actor: str
    source: str = ""


_request: contextvars.ContextVar[HttpRequest | None] = contextvars.ContextVar(
    "mirbad_audit_request", default=None
)
_origin: contextvars.ContextVar[Origin | None] = contextvars.ContextVar(
    "mirbad_audit_origin", default=None
)


@contextlib.contextmanager
def acting_as(actor: str, source: str = "") -> Iterator[None]:
    """Attribute the events recorded inside to ``actor`` (a command, a task)."""
    token = _origin.set(Origin(actor=actor, source=source))
    try:
        yield
    finally:
        _origin.reset(token)


def _address(request: HttpRequest) -> str:
    return str(request.META.get("REMOTE_ADDR") or "")


def _request_actor(request: HttpRequest) -> str:
    # DRF copies the key it authenticated (router.keys.KeyInfo) onto the Django request;
    # read it by shape, since nodes sits below router and must not import it.
    auth = getattr(request, "auth", None)
    prefix = getattr(auth, "prefix", None)
    if isinstance(prefix, str) and prefix:
        return f"key {prefix}… (#{getattr(auth, 'id', '?')})"
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return str(user.get_username())
    return "anonymous"


def current_origin() -> Origin:
    """Who is acting now: an explicit :func:`acting_as`, the bound request, or system."""
    origin = _origin.get()
    if origin is not None:
        return origin
    request = _request.get()
    if request is None:
        return Origin(actor="system")
    return Origin(actor=_request_actor(request), source=_address(request))


def mask(value: Any, *, name: str = "") -> Any:
    """``value`` with every secret replaced by ``********`` (nested dicts and lists too)."""
    if name and _SECRET_NAME.search(name) and value not in (None, "", [], {}):
        return MASK
    if isinstance(value, dict):
        return {str(k): mask(v, name=str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mask(v) for v in value]
    if isinstance(value, str):
        return _BEARER_TEXT.sub("Bearer " + MASK, _API_KEY_TEXT.sub("mbd-" + MASK, value))
    return value


def record(
    action: str,
    *,
    actor: str | None = None,
    source: str | None = None,
    node_id: str = "",
    subject: str = "",
    **detail: Any,
) -> AuditEvent:
    """Store one event (and log it); actor and source default to :func:`current_origin`."""
    origin = current_origin()
    clean = mask(detail)
    event = AuditEvent.objects.create(
        actor=(actor or origin.actor)[:150],
        source=(origin.source if source is None else source)[:64],
        action=action[:60],
        node_id=node_id[:40],
        subject=mask(subject)[:60],
        detail=clean,
    )
    log.info("%s from %s: %s node=%s %s %s", event.actor, event.source or "-", action,
             node_id or "-", event.subject, clean or "")  # fmt: skip
    return event


PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """What a reader asked for; every field optional."""

    action: str = ""  # a name ("login.failed") or a family ("model." or "model")
    actor: str = ""  # contains, any case
    node_id: str = ""
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    before: int | None = None  # the id the previous page ended at (newest first)
    limit: int = PAGE_SIZE


def _when(name: str, raw: str, *, end: bool) -> dt.datetime | None:
    if not raw:
        return None
    moment = parse_datetime(raw) if "T" in raw or " " in raw else None
    if moment is None:
        day = parse_date(raw) if len(raw) == 10 else None
        if day is None:
            raise ServiceError(400, "invalid_request",
                               f"{name}: {raw[:40]!r} is not a date (2026-12-04) or an ISO 8601 "
                               "time (2026-12-04T10:00:00Z)")  # fmt: skip
        moment = dt.datetime.combine(day + dt.timedelta(days=1 if end else 0), dt.time())
    if timezone.is_naive(moment):
        moment = moment.replace(tzinfo=dt.UTC)
    return moment


def _number(name: str, raw: str, *, lowest: int, highest: int) -> int | None:
    if not raw:
        return None
    if not raw.isdigit() or not lowest <= int(raw) <= highest:
        raise ServiceError(400, "invalid_request",
                           f"{name}: give a whole number from {lowest} to {highest}")  # fmt: skip
    return int(raw)


def parse_filter(params: Any) -> AuditFilter:
    """The query parameters of /api/audit, /api/audit.csv and the console's Audit page
    (``action``, ``actor``, ``node``, ``from``, ``to``, ``before``, ``limit``)."""

    def text(name: str, most: int) -> str:
        value = str(params.get(name) or "").strip()
        if len(value) > most:
            raise ServiceError(400, "invalid_request", f"{name}: at most {most} characters")
        return value

    start = _when("from", text("from", 40), end=False)
    end = _when("to", text("to", 40), end=True)
    if start is not None and end is not None and end <= start:
        raise ServiceError(400, "invalid_request", "to: must be after from")
    return AuditFilter(
        action=text("action", 60),
        actor=text("actor", 150),
        node_id=text("node", 40),
        start=start,
        end=end,
        before=_number("before", text("before", 20), lowest=1, highest=2**62),
        limit=_number("limit", text("limit", 5), lowest=1, highest=MAX_PAGE_SIZE) or PAGE_SIZE,
    )


def select(wanted: AuditFilter) -> QuerySet[AuditEvent]:
    """The matching events, newest first (no page cut)."""
    rows = AuditEvent.objects.order_by("-id")
    if wanted.action:
        family = wanted.action.rstrip(".")
        rows = rows.filter(action=family) | rows.filter(action__startswith=family + ".")
    if wanted.actor:
        rows = rows.filter(actor__icontains=wanted.actor)
    if wanted.node_id:
        rows = rows.filter(node_id=wanted.node_id)
    if wanted.start is not None:
        rows = rows.filter(at__gte=wanted.start)
    if wanted.end is not None:
        rows = rows.filter(at__lt=wanted.end)
    return rows


def page(wanted: AuditFilter) -> tuple[list[AuditEvent], int | None]:
    """One page of :func:`select` and the ``before`` of the next page (None: the last)."""
    rows = select(wanted)
    if wanted.before is not None:
        rows = rows.filter(id__lt=wanted.before)
    events = list(rows[: wanted.limit + 1])
    more = len(events) > wanted.limit
    events = events[: wanted.limit]
    return events, (events[-1].pk if more and events else None)


def prune(*, keep_days: int, now: dt.datetime | None = None) -> int:
    """Delete the events older than ``keep_days``; returns how many went."""
    cutoff = (now or timezone.now()) - dt.timedelta(days=keep_days)
    deleted, _ = AuditEvent.objects.filter(at__lt=cutoff).delete()
    if deleted:
        log.info("Pruned %d audit events older than %d days", deleted, keep_days)
    return deleted


class _Echo:
    """A write-only file for csv.writer whose write returns the line."""

    def write(self, value: str) -> str:
        return value


def _cell(value: str) -> str:
    # A cell that a spreadsheet would run as a formula is quoted as text (CSV injection:
    # actor and subject can hold what an attacker typed, e.g. a failed login's name).
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def csv_text(events: Iterable[AuditEvent], *, header: bool = False) -> str:
    """``events`` as CSV lines (columns :data:`CSV_COLUMNS`), the header first if asked."""
    writer = csv.writer(_Echo())
    lines = [writer.writerow(CSV_COLUMNS)] if header else []
    for event in events:
        lines.append(
            writer.writerow(
                [
                    event.at.isoformat(),
                    _cell(event.actor),
                    event.source,
                    event.action,
                    event.node_id,
                    _cell(event.subject),
                    _cell(json.dumps(event.detail, sort_keys=True, separators=(",", ":"))),
                ]
            )
        )
    return "".join(lines)


_BATCH = 500


def _batches(wanted: AuditFilter) -> Iterator[list[AuditEvent]]:
    """Every match, newest first, a batch at a time (by id, so a batch is one query)."""
    rows = select(wanted)
    last: int | None = None
    while True:
        batch = list((rows if last is None else rows.filter(id__lt=last))[:_BATCH])
        if not batch:
            return
        yield batch
        last = batch[-1].pk


def csv_lines(wanted: AuditFilter) -> Iterator[str]:
    """The CSV export (WSGI and the test client)."""
    yield csv_text([], header=True)
    for batch in _batches(wanted):
        yield csv_text(batch)


async def acsv_lines(wanted: AuditFilter) -> AsyncIterator[str]:
    """The CSV export for an ASGI answer: each batch is read in Django's sync thread."""
    batches = _batches(wanted)
    next_batch = sync_to_async(lambda: next(batches, None))
    yield csv_text([], header=True)
    while (batch := await next_batch()) is not None:
        yield csv_text(batch)


Handler = Callable[[HttpRequest], Any]


class AuditContextMiddleware:
    """Binds the request being served, so :func:`record` knows who acts and from where."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        token = _request.set(request)
        try:
            return self.get_response(request)
        finally:
            _request.reset(token)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        token = _request.set(request)
        try:
            response: Awaitable[HttpResponseBase] = self.get_response(request)
            return await response
        finally:
            _request.reset(token)


# -- logins (Django's signals: the console's and the admin's login views alike) -------


def _on_login(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    record("login", actor=str(user.get_username()),
           source=_address(request) if request is not None else "")  # fmt: skip


def _on_logout(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    if user is not None:
        record("logout", actor=str(user.get_username()),
               source=_address(request) if request is not None else "")  # fmt: skip


def _on_login_failed(
    sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **kwargs: Any
) -> None:
    # The name as typed (it may not exist); Django has already cleansed the password out
    # of ``credentials``. Refused attempts past the login throttle never get here, so an
    # attacker cannot grow this table faster than the throttle allows.
    name = next((str(v) for k, v in credentials.items() if "user" in k.lower()), "")
    record("login.failed", actor=name or "(no name)",
           source=_address(request) if request is not None else "")  # fmt: skip


def connect_signals() -> None:
    """Hook the login events (nodes.apps.NodesConfig.ready)."""
    from django.contrib.auth import signals

    signals.user_logged_in.connect(_on_login, dispatch_uid="mirbad-audit-login")
    signals.user_logged_out.connect(_on_logout, dispatch_uid="mirbad-audit-logout")
    signals.user_login_failed.connect(_on_login_failed, dispatch_uid="mirbad-audit-login-failed")
