"""Console pages (thin: they read services and the status cache): the Overview, add node,
and the node actions; the Nodes list and node page are in console/node_views.py."""

from __future__ import annotations

import datetime
import functools
import ipaddress
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages
from django.db import DEFAULT_DB_ALIAS
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from console import node_views
from console.access import operator_required
from core import supervision
from core.errors import ServiceError
from models_registry import kpis
from models_registry import listing as model_listing
from models_registry import services as model_services
from models_registry.models import ModelDefinition
from nodes import listing, operations, rotation, services, status_cache, telemetry
from nodes import status as node_status
from nodes import takeover as fencing_takeover
from nodes.models import CertRotation, Node
from nodes.status_cache import NodeStatus
from router.recent import recent as recent_requests

__all__ = ["download_row", "operator_required"]


# The Overview's fleet table shows the first nodes by id; the Nodes page has them all.
OVERVIEW_ROWS = 100


@dataclass(slots=True)
class _NodeFacts:
    """What the Overview reads of every node: ``nodes.status.effective``'s registry side,
    the attention test, and the row as read, to build a Node from when it is shown.

    A Node instance costs about 10 µs to build, a thousand of them a tenth of the page
    (1,000 nodes); only the table's and the attention lines' nodes become one
    (:meth:`node`), from the values read.
    """

    pk: int
    node_id: str
    approved: bool
    revoked: bool
    maintenance_until: datetime.datetime | None
    cert_renewal_error: str
    values: tuple[Any, ...]  # _node_columns()' values, for Node.from_db
    open_rotations: list[CertRotation] = field(default_factory=list)  # attach_open_rotations

    def maintenance_left(self) -> float:
        # Node's own rule, which reads maintenance_until only.
        return Node.maintenance_left(cast(Node, self))

    def node(self) -> Node:
        """The Node ``.only(*node_views.ROW_FIELDS)`` would have loaded, open rotations set."""
        node = Node.from_db(DEFAULT_DB_ALIAS, _node_columns(), self.values)
        node.open_rotations = self.open_rotations  # type: ignore[attr-defined]  # see node_views
        return node


@functools.cache
def _node_columns() -> list[str]:
    """The primary key and node_views.ROW_FIELDS in Node's field order (what from_db takes)."""
    wanted = {"id", *node_views.ROW_FIELDS}
    return [f.attname for f in Node._meta.concrete_fields if f.attname in wanted]


def _read_nodes() -> list[_NodeFacts]:
    """Every node by id as plain values (one query) with its open rotations (one more)."""
    columns = _node_columns()
    at = {name: columns.index(name) for name in columns}
    pk, node_id, approved, revoked = at["id"], at["node_id"], at["approved"], at["revoked"]
    until, renewal = at["maintenance_until"], at["cert_renewal_error"]
    facts = [
        _NodeFacts(
            row[pk], row[node_id], row[approved], row[revoked], row[until], row[renewal], row
        )
        for row in Node.objects.order_by("node_id").values_list(*columns)
    ]
    # It sets open_rotations only, which _NodeFacts has.
    listing.attach_open_rotations(cast(list[Node], facts))
    return facts


def _may_need_attention(node: _NodeFacts, status: NodeStatus, stuck: set[str]) -> bool:
    """Whether Needs attention may have a line for ``node`` (``_attention`` decides): only
    these nodes, and the table's, get a row built (a thousand Online nodes do not)."""
    if node.revoked:
        return False
    return bool(
        node_status.state_of(status) != "Online"
        or status.get("operations")
        or node.node_id in stuck
        or node.cert_renewal_error
        or node.open_rotations
    )


def _fleet(*, table: bool = True) -> dict[str, Any]:
    """Everything the Overview shows, read once: registry, statuses, history, flags.

    Tiles and Needs attention count the whole fleet; rows are built only for the table's
    first ``OVERVIEW_ROWS`` nodes and for the nodes that may need attention. Every model
    and node is read in a fixed number of queries, none with a list of every id
    (models_registry.listing.judge_registry).
    """
    nodes = _read_nodes()
    statuses = node_status.read_many(nodes)
    model_counts, model_rows, flags = _models(statuses, nodes)
    stuck = _stuck_operations()
    shown = nodes[:OVERVIEW_ROWS] if table else []
    shown_ids = {n.node_id for n in shown}
    stuck_ids = set(stuck)
    row_nodes = [
        n
        for n in nodes
        if n.node_id in shown_ids or _may_need_attention(n, statuses[n.node_id], stuck_ids)
    ]
    built = node_views.rows_for([n.node() for n in row_nodes], statuses)
    rows = {row["node_id"]: row for row in built}
    download_rows = [
        {"node_id": node_id, **download_row(d)}
        for node_id, status in sorted(statuses.items())
        for d in ((status or {}).get("downloads") or {}).values()
    ]
    sums = telemetry.engine_sums([n.node_id for n in nodes], ("genTps", "waiting"))
    stale, as_of = status_cache.oldest_as_of(statuses)
    states = [node_status.state_of(statuses[n.node_id]) for n in nodes]
    return {
        "tiles": _tiles(states, model_counts, sums),
        "attention": _attention(
            [rows[n.node_id] for n in row_nodes],
            model_rows,
            flags,
            download_rows,
            stuck,
        ),
        "nodes": [rows[n.node_id] for n in shown],
        "nodes_total": len(nodes),
        "takeover_needed": "PendingTakeover" in states,
        "redis_unreachable": stale,
        "statuses_as_of": _utc(as_of),
    }


def _models(
    statuses: dict[str, NodeStatus], nodes: list[_NodeFacts]
) -> tuple[dict[str, int], list[dict[str, Any]], dict[int, kpis.Flags]]:
    """The models tile's counts, the models that have a Needs attention line (by served
    name), and the flagged ones.

    The whole registry is read as plain values, two queries: every placement with its
    model's name and the columns its restart-pending check needs, judged in one pass
    against the statuses read once (``listing.judge_registry``: replicas, Ready replicas,
    restart pending, memoized), and the count of definitions. A model with a Ready
    replica is Ready (``services.replicas_state``'s best); the others' state is that
    rule's, and rows are built for the models that have a line only.
    """
    registry = model_listing.judge_registry({n.pk: n for n in nodes}, statuses)
    replicas, pending = registry.replicas, registry.pending
    flags = kpis.ready_flags(registry.ready)
    ready = {model_id for model_id, _, _ in registry.ready}
    rows: list[dict[str, Any]] = []
    for model_id, served_name in registry.names.items():  # an unplaced model has no line
        if model_id in ready and model_id not in flags and model_id not in pending:
            continue  # Ready, no line: most of a fleet
        state = model_services.replicas_state(replicas[model_id], statuses)
        if state["state"] == "Failed" or model_id in flags or model_id in pending:
            rows.append(
                {
                    "id": model_id,
                    "served_name": served_name,
                    "state": state["state"],
                    "error": state["error"] or "",
                    "restart_pending": model_id in pending,
                }
            )
    total = ModelDefinition.objects.count()
    counts = {"models_ready": len(ready), "models_placed": len(replicas), "models_total": total}
    return counts, rows, flags


@operator_required
def overview(request: HttpRequest) -> HttpResponse:
    """Tiles (nodes by state, models, requests per minute, tokens per second, queue) and
    what needs the operator's attention, each line linking to its page; then the fleet."""
    fleet = _fleet()
    return render(
        request,
        "console/overview.html",
        {
            **fleet,
            **node_views.table_context(request, fleet["nodes"]),
            "restarts": supervision.restart_lines(settings.MIRBAD.run_dir),
        },
    )


@operator_required
def overview_summary(request: HttpRequest) -> HttpResponse:
    """The tiles and Needs attention alone, as live.js swaps them in after an event."""
    return render(request, "console/overview_summary.html", _fleet(table=False))


def _tiles(
    node_states: list[str], model_counts: dict[str, int], sums: dict[str, float | None]
) -> dict[str, Any]:
    """Nodes by state, the models' counts, and the fleet's tokens per second and queue
    (the sums over every engine of the current telemetry; None, a dash, when none is known)."""
    return {
        "nodes_by_state": sorted(Counter(node_states).items()),
        "nodes_total": len(node_states),
        **model_counts,
        "requests_per_minute": recent_requests.last_minute(),
        "tokens_per_second": sums["genTps"],
        "queue_depth": sums["waiting"],
    }


def _stuck_operations() -> dict[str, list[dict[str, Any]]]:
    """The master's operations open 30 s or more, by node (one query for the fleet)."""
    now = time.time()
    found: dict[str, list[dict[str, Any]]] = {}
    for op in operations.stuck(node_views.OPERATION_ATTENTION_SECONDS):
        found.setdefault(op.node.node_id, []).append(node_views.master_operation(op, now))
    return found


def _attention(
    node_rows: list[dict[str, Any]],
    model_rows: list[dict[str, Any]],
    flags: dict[int, kpis.Flags],
    download_rows: list[dict[str, Any]],
    master_operations: dict[str, list[dict[str, Any]]] | None = None,
) -> list[dict[str, str]]:
    """One line per thing that needs the operator, most urgent kinds first, each with the
    page that explains it."""
    lines: list[dict[str, str]] = []

    def add(kind: str, subject: str, text: str, url: str) -> None:
        lines.append({"kind": kind, "subject": subject, "text": text, "url": url})

    for n in node_rows:
        if n["revoked"]:
            continue
        url = n["url"]  # its node page (an Offline fleet has a line per node)
        if n["state"] in ("Offline", "Degraded", "Incompatible", "PendingTakeover"):
            detail = "; ".join(
                f"{r.get('code')}: {r.get('message', '')}".rstrip(": ") for r in n["reason_details"]
            )
            error = f" Last error: {n['last_error']}" if n["last_error"] else ""
            add("node", n["node_id"], f"{n['state']}. {detail}{error}".strip(), url)
        elif n["state"] == "PendingApproval":
            add("node", n["node_id"], f"Waiting for approval (key {n['fingerprint']}).", url)
        for op in n["operations"]:
            if op["stuck"]:
                add("operation", n["node_id"], f"Agent operation {op['kind']} of "
                    f"{op['instance_id'] or '-'} open, opened {op['age']} ({op['id']}).", url)  # fmt: skip
        for op in (master_operations or {}).get(n["node_id"], []):
            attempts = f", {op['attempts']} attempt(s)" if op["attempts"] else ""
            add("operation", n["node_id"], f"Master operation {op['kind']} of "
                f"{op['target'] or '-'} open, opened {op['age']}{attempts} ({op['id']}).", url)  # fmt: skip
        cert = n["certificate"]
        if cert.get("renewalError"):
            add("certificate", n["node_id"], f"Renewal failed: {cert['renewalError']}", url)
        if cert.get("rotation"):
            add(
                "operation",
                n["node_id"],
                f"Certificate rotation at {cert['rotation']['stage']}.",
                url,
            )
    # The model's URL is its page's path (console/urls.py), built without reverse(): the
    # Overview walks every model of the fleet, and only a few of them have a line.
    model_page = reverse("model", args=[0]).removesuffix("0/")
    for m in model_rows:
        url = f"{model_page}{m['id']}/"
        if m["state"] == "Failed":
            add("model", m["served_name"], f"Failed: {m['error'] or 'no cause reported'}", url)
        flag = flags.get(m["id"])
        if flag and (flag["stalled"] or flag["slow"]):
            add(
                "model",
                m["served_name"],
                ("Stalled: " if flag["stalled"] else "Slow: ") + flag["reason"],
                url,
            )
        if m["restart_pending"]:
            add(
                "model",
                m["served_name"],
                "Restart pending: its settings changed since it started.",
                url,
            )
    for d in download_rows:
        if d["state"] == "Failed":
            add(
                "download",
                f"{d['node_id']}/{d['folder']}",
                f"Download failed: {d['error']}",
                reverse("downloads"),
            )
    return lines


def _utc(moment: float | None) -> datetime.datetime | None:
    return datetime.datetime.fromtimestamp(moment, datetime.UTC) if moment is not None else None


def download_row(download: dict) -> dict[str, object]:
    """Progress as the console shows it: no percentage without a known total."""
    done, total = download.get("bytesDone") or 0, download.get("bytesTotal")
    rate = download.get("rateBytesPerSecond")
    if isinstance(total, int) and total > 0:
        progress = f"{done / 2**30:.2f} / {total / 2**30:.2f} GiB ({100 * done / total:.0f} %)"
    else:
        progress = f"{done / 2**30:.2f} GiB so far"
    return {
        "folder": download.get("folder"),
        "state": download.get("state"),
        "progress": progress,
        "rate": f"{rate / 2**20:.1f} MiB/s" if isinstance(rate, int | float) else "",
        "error": download.get("error") or "",
    }


_JOIN_SESSION_KEY = "console.join"


def _loopback(url: str) -> bool:
    """True when other machines cannot reach ``url``'s host (127.0.0.0/8, ::1, localhost)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _show_join(request: HttpRequest, join: dict[str, object], rekey: bool) -> HttpResponse:
    """Keep the token for exactly the next GET (post/redirect/get): a reload neither makes
    a second token nor shows this one again, and the token never appears in a URL."""
    request.session[_JOIN_SESSION_KEY] = {"join": join, "rekey": rekey}
    return redirect("add-node")


@operator_required
def add_node(request: HttpRequest) -> HttpResponse:
    """Add node: a single-use join token, shown once, with the commands to run."""
    if request.method == "POST":
        node_id = request.POST.get("node_id", "").strip()
        try:
            join = services.create_join_token(node_id=node_id)
        except ServiceError as exc:
            refused = {"error": exc.message, "node_id": node_id[:40]}
            return render(request, "console/add_node.html", refused, status=400)
        return _show_join(request, join, rekey=False)
    if request.method != "GET":
        return HttpResponseNotAllowed(["GET", "POST"])
    shown = request.session.pop(_JOIN_SESSION_KEY, None)
    context: dict[str, object] = {}
    if shown:
        join = shown["join"]
        context = {
            "join": join,
            "rekey": shown["rekey"],
            "loopback": _loopback(str(join["enrollUrl"])),
        }
    return render(request, "console/add_node.html", context)


MAINTENANCE_MINUTES_MAX = 7 * 24 * 60


def _maintenance_seconds(raw: str) -> int:
    """The console's maintenance form gives minutes; the service takes seconds."""
    try:
        minutes = int(raw)
    except ValueError:
        raise ServiceError(
            400, "invalid_request", "minutes: give the hold's length as a whole number of minutes"
        ) from None
    if not 1 <= minutes <= MAINTENANCE_MINUTES_MAX:
        raise ServiceError(
            400, "invalid_request", f"minutes: from 1 to {MAINTENANCE_MINUTES_MAX} (a week)"
        )
    return minutes * 60


NODE_ACTIONS = {
    "approve": ("Approved", lambda node_id, post, user: services.approve_node(node_id)),
    "revoke": ("Revoked", lambda node_id, post, user: services.revoke_node(node_id)),
    "drain": ("Draining", lambda node_id, post, user: services.set_draining(node_id, True)),
    "undrain": (
        "No longer draining",
        lambda node_id, post, user: services.set_draining(node_id, False),
    ),
    "maintenance": (
        "Held for maintenance",
        lambda node_id, post, user: services.start_maintenance(
            node_id,
            seconds=_maintenance_seconds(post.get("minutes", "")),
            reason=post.get("reason", "")[:200],
        ),
    ),
    "end-maintenance": (
        "Maintenance ended",
        lambda node_id, post, user: services.end_maintenance(node_id),
    ),
    # Two-phase, driven in Celery (docs/decisions.md D55).
    "rotate": (
        "Certificate rotation requested",
        lambda node_id, post, user: rotation.rotate_now(node_id, actor=user),
    ),
}


@operator_required
@require_POST
def node_action(request: HttpRequest, node_id: str, action: str) -> HttpResponse:
    """One node action, then a redirect (post/redirect/get) to the page the form was on,
    with the outcome as a message."""
    entry = NODE_ACTIONS.get(action)
    if entry is None:
        return HttpResponse(status=404)
    done, run = entry
    try:
        run(node_id, request.POST, str(request.user))
    except ServiceError as exc:
        messages.error(request, f"{node_id}: {exc.message}")
    else:
        messages.success(request, f"{node_id}: {done}.")
    back = request.POST.get("back")
    if back == "node":
        return redirect("node", node_id=node_id)  # the form on the node page
    if back == "nodes":
        return redirect("nodes")
    return redirect("overview")


@operator_required
@require_POST
def takeover(request: HttpRequest) -> HttpResponse:
    try:
        fencing_takeover.takeover()
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("overview")


@operator_required
@require_POST
def rekey_node(request: HttpRequest, node_id: str) -> HttpResponse:
    """Rekey: a single-use token for a node whose identity was lost; engines keep running."""
    try:
        join = services.rekey_node(node_id)
    except ServiceError as exc:
        messages.error(request, f"{node_id}: {exc.message}")
        return (
            redirect("node", node_id=node_id)
            if Node.objects.filter(node_id=node_id).exists()
            else redirect("nodes")
        )
    return _show_join(request, join, rekey=True)
