"""The Nodes list, one node's row and its page (thin: they read the registry, the status
cache and the telemetry history; docs/operator-guide.md "Nodes in the console")."""

from __future__ import annotations

import datetime
import html
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Literal
from urllib.parse import quote

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import get_token
from django.shortcuts import render
from django.template import Context
from django.template.base import render_value_in_context
from django.template.defaultfilters import date as date_filter
from django.template.defaultfilters import truncatechars
from django.urls import reverse
from django.utils.safestring import SafeString
from django.utils.timezone import is_aware, localtime

from console import pager
from console.access import operator_required
from console.formats import age_text, gib, iso_epoch, when
from core import paging
from core.errors import ServiceError
from models_registry.models import Placement
from nodes import events, listing, operations, rotation, telemetry
from nodes import labels as node_labels
from nodes import status as node_status
from nodes.models import AuditEvent, CertRotation, MasterOperation, Node
from nodes.status_cache import NodeStatus
from protocol.states import InstanceState

# A sample older than this is never shown as current (docs/decisions.md D63).
CURRENT_FOR_SECONDS = telemetry.CURRENT_SECONDS
# The Nodes list's chips (nodes.listing.SHOW); anything else is ignored with a message.
FILTERS = listing.SHOW
MAX_QUERY = 100
open_rotations = listing.open_rotations


def _bar(used: object, total: object) -> dict[str, Any] | None:
    """A used/total pair as bar.html prints it (formatted here: a page of 100 rows pays
    for every template filter); None when unknown. live.js bar() prints the same."""
    if not isinstance(used, int | float) or not isinstance(total, int | float) or total <= 0:
        return None
    percent = max(0.0, min(100.0, 100 * used / total))
    return {
        "percent": f"{percent:.0f}",
        "text": f"{used / 2**30:.1f} / {total / 2**30:.1f} GiB",
    }


def model_counts(
    node_ids: Iterable[str], statuses: dict[str, NodeStatus]
) -> dict[str, tuple[int, int]]:
    """Per node: (Ready replicas, placed replicas), one query for all nodes."""
    placed: Counter[str] = Counter()
    ready: Counter[str] = Counter()
    wanted = list(node_ids)
    # Three columns, no Placement built: the Overview counts hundreds of replicas.
    placements = Placement.objects.values_list("model_id", "id", "node__node_id")
    if len(wanted) <= listing.IN_MAX:  # more: every placement (no IN of every id, SQLite)
        placements = placements.filter(node__node_id__in=wanted)
    for model_id, pk, node_id in placements:
        placed[node_id] += 1
        instance_id = Placement.instance_id_of(model_id, pk)
        inst = ((statuses.get(node_id) or {}).get("instances") or {}).get(instance_id)
        if (inst or {}).get("state") == InstanceState.READY:
            ready[node_id] += 1
    return {node_id: (ready[node_id], placed[node_id]) for node_id in wanted}


# The Node columns a row reads (node_row, the certificate's summary, the status rule):
# a read of the whole fleet loads only these (another one read by a row would cost a
# query per node, which tests/test_query_counts.py catches).
ROW_FIELDS = (
    "node_id",
    "display_name",
    "address",
    "approved",
    "revoked",
    "draining",
    "maintenance_until",
    "maintenance_reason",
    "spki_pin",
    "cert_serial",
    "cert_not_after",
    "cert_renewal_error",
    "agent_version",
    "protocol_version",
    "os",
    "arch",
    "labels",
)


def node_row(
    node: Node,
    status: NodeStatus,
    open_rotation: CertRotation | None,
    models: tuple[int, int] = (0, 0),
    now: float | None = None,
    *,
    looked_up: bool = False,
    node_base: str = "",
) -> dict[str, Any]:
    """One node as the Overview, the Nodes list and the node page show it.

    Values come from the last telemetry the monitor stored; when that sample is older than
    a minute (an Offline node, a stuck monitor) they are marked ``stale`` with their age,
    so the page greys them instead of presenting them as current.
    """
    moment = time.time() if now is None else now
    sample = status.get("telemetry") or {}
    memory = sample.get("memory") or {}
    seen = status.get("lastSeen")
    state = node_status.state_of(status)
    # lastSeen is the master's clock (a skewed agent clock cannot make a sample look fresh);
    # the monitor pulls telemetry every 5 s while it is in contact.
    seen_ago = moment - seen if isinstance(seen, int | float) else None
    stale = state == "Offline" or seen_ago is None or seen_ago > CURRENT_FOR_SECONDS
    gpus = [
        {
            "index": g.get("index"),
            "label": f"GPU {g.get('index')}",
            "name": g.get("name") or "GPU",
            "bar": _bar(g.get("memoryUsedBytes"), g.get("memoryTotalBytes")),
            "util": f"{u:.0f}"
            if isinstance(u := g.get("utilizationPercent"), int | float)
            else None,
        }
        for g in sample.get("gpus") or []
        if isinstance(g, dict)
    ]
    reasons = [r for r in status.get("reasons", []) if isinstance(r, dict)]
    return {
        "node_id": node.node_id,
        # The node page's path; its actions are under it (console/urls.py).
        "url": f"{node_base or _node_base()}{quote(node.node_id, safe='')}/",
        "display_name": node.display_name,
        "labels": node_labels.text(node.labels),
        "state": state,
        "approved": node.approved,
        "revoked": node.revoked,
        "draining": node.draining,
        "maintenance_until": node.maintenance_until if node.maintenance_left() else None,
        "maintenance_reason": node.maintenance_reason,
        "fingerprint": f"SHA256:{node.spki_pin}" if node.spki_pin else "",
        "certificate": certificate(
            rotation.certificate_summary(node, open_rotation, looked_up=looked_up)
        ),
        "reasons": ", ".join(r.get("code", "") for r in reasons),
        "reason_details": reasons,
        "address": node.address,
        "os_arch": " · ".join(v for v in (node.os, node.arch) if v),
        "cpu": f"{cpu:.0f}" if isinstance(cpu := sample.get("cpuPercent"), int | float) else None,
        "mem_bar": _bar(memory.get("usedBytes"), memory.get("totalBytes")),
        "gpus": gpus,
        "models_ready": models[0],
        "models_placed": models[1],
        # Numbers as text: a list's template localizes every number it prints (a 200-row
        # page printed 1,400), and these print the same either way.
        "models_text": f"{models[0]} / {models[1]}",
        "agent_version": node.agent_version,
        "protocol": node.protocol_version,
        "protocol_text": f" · v{node.protocol_version}" if node.protocol_version else "",
        "last_seen": when_epoch(seen),
        "last_seen_age": age_text(seen_ago) if seen_ago is not None else "never",
        "stale": stale,
        "last_error": status.get("lastError", "") if state != "Online" else "",
        "operations": _operations(status, moment),
    }


# An operation the agent has had open this long is shown as needing attention (a launch
# answers in a moment; one still open after this is stuck or its answer was lost).
OPERATION_ATTENTION_SECONDS = 30.0


def _operations(status: NodeStatus, now: float) -> list[dict[str, Any]]:
    """The agent's open operations with their age (from its own clock: roughly)."""
    out = []
    for op in status.get("operations") or []:
        opened = iso_epoch(op.get("openedAt"))
        age = now - opened if opened is not None else None
        out.append(
            {
                "kind": op.get("kind", ""),
                "instance_id": op.get("instanceId", ""),
                "id": op.get("id", ""),
                "age": age_text(age) if age is not None else "",
                "stuck": age is not None and age >= OPERATION_ATTENTION_SECONDS,
            }
        )
    return out


def master_operation(op: MasterOperation, now: float) -> dict[str, Any]:
    """One of the master's open operations as the node page and Needs attention show it."""
    age = now - op.opened_at.timestamp()
    return {
        "kind": op.kind,
        "target": op.target,
        "id": op.operation_id,
        "age": age_text(age),
        "attempts": op.attempts,
        "summary": op.summary,
        "stuck": age >= OPERATION_ATTENTION_SECONDS,
    }


def certificate(summary: events.CertificateSummary) -> dict[str, object]:
    """The summary with its times as the page prints them (live.js prints the same)."""
    return {**summary, "not_after": when(summary["notAfter"]), "renew_at": when(summary["renewAt"])}


def when_epoch(moment: object) -> str:
    if not isinstance(moment, int | float):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(moment))


def _node_base() -> str:
    """The node pages' path up to the node id, built once per list rather than a
    ``{% url %}`` per link: three links a row were a fifth of a 200-row page's render."""
    return reverse("node", args=["0"]).removesuffix("0/")


def _first_open(node: Node) -> CertRotation | None:
    opened: list[CertRotation] = getattr(node, "open_rotations", [])
    return opened[0] if opened else None


def rows_for(
    nodes: list[Node], statuses: dict[str, NodeStatus] | None = None
) -> list[dict[str, Any]]:
    """Rows for nodes loaded with ``open_rotations()``: one Redis and one DB round trip."""
    if statuses is None:
        statuses = node_status.read_many(nodes)
    counts = model_counts([n.node_id for n in nodes], statuses)
    now = time.time()
    base = _node_base()
    return [
        node_row(
            node,
            statuses[node.node_id],
            _first_open(node),
            counts[node.node_id],
            now,
            looked_up=hasattr(node, "open_rotations"),
            node_base=base,
        )
        for node in nodes
    ]


@operator_required
def nodes_list(request: HttpRequest) -> HttpResponse:
    """The nodes with their state, telemetry bars, models, agent and certificate, a page of
    ``core.paging.PAGE_SIZE`` at a time; search, filters and the page are GET parameters
    (``q``, ``show``, ``state``, ``model``, ``page``; nodes.listing), so a filtered view can
    be bookmarked and shared."""
    show = request.GET.get("show", "all")
    notice = ""
    if show not in FILTERS:
        notice = (
            f"Unknown filter '{show[:40]}': showing all nodes (use one of {', '.join(FILTERS)})."
        )
        show = "all"
    context: dict[str, Any] = {
        "show": show,
        "filters": FILTERS,
        "states": listing.STATES,
        "q": request.GET.get("q", "").strip()[:MAX_QUERY],
        "model": request.GET.get("model", "").strip()[:200],
        "label": request.GET.get("label", "").strip()[:200],
        "state": request.GET.get("state", "")[:200],
        "notice": notice,
        "nodes": [],
    }
    try:
        # A long search is cut, as the box cuts it, rather than refused.
        params = request.GET.copy()
        params["q"] = context["q"]
        wanted = replace(listing.parse_filter(params, search_name="q"), show=show)
        number = paging.page_number(request.GET)
        found = listing.select(wanted, paging.Page(number=number, pages=number).window)
        page = paging.console_page(number, found.count)
        if page.number != number:  # past the last page (a shared link, fewer nodes now)
            found = listing.select(wanted, page.window)
    except ServiceError as exc:
        context["notice"] = exc.message
        return render(request, "console/nodes.html", context, status=exc.status)
    context.update(
        **table_context(request, rows_for(found.nodes, found.statuses)),
        total=found.total,
        filtered=wanted.active or page.number > 1,
        pager=pager.links(request.GET, page, found.count),
    )
    return render(request, "console/nodes.html", context)


@operator_required
def node_row_fragment(request: HttpRequest, node_id: str) -> HttpResponse:
    """One ``<tr>`` exactly as the list renders it: live.js swaps it in when a node appears
    or changes state, so a live row equals a reloaded one (approve button included)."""
    row = rows_for([_node_or_404(node_id)])[0]
    return HttpResponse(row_html(row, csrf_input(get_token(request))))


def _engines(node: Node, status: NodeStatus, point: telemetry.Point | None) -> list[dict[str, Any]]:
    """The node's engine instances with their model, state, cores, memory and queue."""
    placements = {
        p.instance_id: p for p in Placement.objects.filter(node=node).select_related("model")
    }
    engines: dict[str, telemetry.EnginePoint] = point["engines"] if point else {}
    rows = []
    for instance_id, inst in sorted((status.get("instances") or {}).items()):
        placement = placements.get(instance_id)
        kpi: dict[str, Any] = dict(engines.get(instance_id) or {})
        rows.append(
            {
                "instance_id": instance_id,
                "model": placement.model.served_name if placement else "",
                "model_id": placement.model.pk if placement else None,
                "state": inst.get("state", ""),
                "cpu": kpi.get("cpu"),
                "rss_gib": gib(kpi.get("rss")),
                "running": kpi.get("running"),
                "waiting": kpi.get("waiting"),
                "gen_tps": kpi.get("genTps"),
            }
        )
    return rows


def _current(node: Node) -> dict[str, Any]:
    """What node_current.html shows: the row, load, cores, disks and engines."""
    status = node_status.read(node)
    row = rows_for([node], {node.node_id: status})[0]
    sample = status.get("telemetry") or {}
    fresh = not row["stale"]  # stale values keep their bars, greyed, but no load or cores
    return {
        "n": row,
        "load": sample.get("load") if fresh else None,
        "cores": sample.get("cpuPerCore") if fresh else None,
        "disks": [
            {
                "path": d.get("path"),
                "bar": _bar(
                    (d.get("totalBytes") or 0) - (d.get("freeBytes") or 0), d.get("totalBytes")
                ),
            }
            for d in sample.get("disks") or []
            if isinstance(d, dict)
        ],
        "engines": _engines(node, status, telemetry.latest(node.node_id)),
        # Beside the agent's open operations (in the row): what the master still waits
        # on, or lost the answer of (one query).
        "master_operations": [
            master_operation(op, time.time()) for op in operations.open_for(node)
        ],
    }


def _node_or_404(node_id: str) -> Node:
    node = Node.objects.prefetch_related(open_rotations()).filter(node_id=node_id).first()
    if node is None:
        raise Http404(f"No node '{node_id}'.")
    return node


@operator_required
def node_page(request: HttpRequest, node_id: str) -> HttpResponse:
    """One node: state, current telemetry, engines, charts, logs, certificate, actions,
    rotations and audit events (live over ``/ws/nodes/<id>/``)."""
    node = _node_or_404(node_id)
    return render(
        request,
        "console/node.html",
        {
            **_current(node),
            "address": node.address,
            "rotations": CertRotation.objects.filter(node=node).order_by("-created_at")[:10],
            "audit": AuditEvent.objects.filter(node_id=node.node_id).order_by("-at")[:25],
        },
    )


@operator_required
def node_current(request: HttpRequest, node_id: str) -> HttpResponse:
    """The node page's current block alone, as live.js swaps it in after an event."""
    return render(request, "console/node_current.html", _current(_node_or_404(node_id)))


@operator_required
def node_history(request: HttpRequest, node_id: str) -> HttpResponse:
    """The node's telemetry points for its charts (``window`` 1h or 24h), oldest first."""
    window: Literal["1h", "24h"] = "24h" if request.GET.get("window") == "24h" else "1h"
    if request.GET.get("window", "1h") not in ("1h", "24h"):
        return JsonResponse(
            {"error": {"code": "invalid_request", "message": "window: one of 1h, 24h."}}, status=400
        )
    if not Node.objects.filter(node_id=node_id).exists():
        raise Http404(f"No node '{node_id}'.")
    return JsonResponse(
        {"nodeId": node_id, "window": window, "points": telemetry.series(node_id, window)}
    )


# -- The list's rows as HTML, written in Python -------------------------------------------
#
# Django's template engine spent about 80% of the Nodes page's time on a row template's
# 200 rows (some 15,000 variable lookups and escapes; issue 19). These functions write
# every list row (the Nodes page, the Overview, the live row fragment) from the row
# dicts; tests/console/test_nodes_pages.py holds them byte-equal to the template they
# replaced (tests/console/node_row_reference.html) over every branch.

_VALUES = Context()  # autoescape on, the settings' localization: as a page's context
_ERROR_CLASS = ' class="error"'
_NOT_PROVIDED = "NOTPROVIDED"  # the csrf context processor's value without a request
_DASH = "\u2013"  # what the templates print for no value
_STALE_CLASS = ' class="stale"'


def _e(value: object) -> str:
    """``{{ value }}`` as a template prints it (escaped, localized when not text)."""
    if type(value) is str:  # SafeString falls through: never escaped twice
        return html.escape(value)
    return str(render_value_in_context(value, _VALUES))


def _local(moment: Any) -> Any:
    """A time as a template hands it to ``|date`` (an aware one in the current zone)."""
    return (
        localtime(moment) if isinstance(moment, datetime.datetime) and is_aware(moment) else moment
    )


def _bar_html(b: dict[str, Any] | None) -> str:
    if not b:
        return _DASH
    text = _e(b["text"])
    return f'<meter min="0" max="100" value="{_e(b["percent"])}" title="{text}"></meter> {text}'


def _gpus_html(gpus: list[dict[str, Any]]) -> str:
    parts = []
    for g in gpus:
        util = g["util"]
        extra = f" · {_e(util)} %" if util is not None else ""
        parts.append(f'<div class="gpu">{_e(g["label"])}: {_bar_html(g["bar"])}{extra}</div>')
    return "".join(parts) or _DASH


def _cert_html(c: dict[str, Any]) -> str:
    out = f"until {_e(c['not_after'])}" if c["not_after"] else _DASH
    if c["rotation"]:
        stage = _e(c["rotation"]["stage"])
        out += f' <span class="badge" data-rotation="{stage}">Rotating: {stage}</span>'
    if c["renewalError"]:
        out += f' <span class="error" title="{_e(c["renewalError"])}">renewal failed</span>'
    return out


def _operations_html(ops: list[dict[str, Any]]) -> str:
    parts = [
        f'<div{_ERROR_CLASS if op["stuck"] else ""} title="{_e(op["id"])}">'
        f"{_e(op['kind'])} {_e(op['instance_id'])} · {_e(op['age'])}</div>"
        for op in ops
    ]
    return "".join(parts) or _DASH


def _form(url: str, action: str, label: str, csrf: str, confirm: str = "") -> str:
    return (
        f'<form method="post" action="{url}{action}/" class="inline">{csrf}<button '
        f'type="submit" name="{action}" data-action="{action}"{confirm}>{label}</button></form>'
    )


def _actions_html(n: dict[str, Any], url: str, csrf: str) -> str:
    if n["revoked"]:
        return ""
    approve = ""
    if not n["approved"]:
        approve = f'<code class="fingerprint">{_e(n["fingerprint"])}</code> ' + _form(
            url, "approve", "Approve", csrf
        )
    if n["draining"]:
        drain = _form(url, "undrain", "Undrain", csrf)
    else:
        drain = _form(url, "drain", "Drain", csrf)
    confirm = f' data-confirm="Revoke {_e(n["node_id"])}? It will be refused from now on."'
    revoke = _form(url, "revoke", "Revoke", csrf, confirm)
    return f"\n      {approve}\n      {drain}\n      {revoke}\n    "


def csrf_input(token: str) -> str:
    """What ``{% csrf_token %}`` writes for ``token``."""
    if token in ("", _NOT_PROVIDED):
        return ""
    return f'<input type="hidden" name="csrfmiddlewaretoken" value="{html.escape(token)}">'


def row_html(n: dict[str, Any], csrf: str) -> str:
    """One :func:`node_row` as a ``<tr>``; ``csrf`` is
    :func:`csrf_input`'s answer for the page's token."""
    node_id = _e(n["node_id"])
    url = _e(n["url"])
    state = _e(n["state"])
    name = n["display_name"]
    maintenance = ""
    if n["maintenance_until"]:
        until = date_filter(_local(n["maintenance_until"]), "H:i")
        maintenance = (
            f' <span class="badge chip" title="{_e(n["maintenance_reason"])}">'
            f"Maintenance until {_e(until)} UTC</span>"
        )
    error = n["last_error"]
    cpu = n["cpu"]
    seen = n["last_seen"]
    return "".join(
        (
            f'<tr data-node="{node_id}" data-state="{state}" '
            f'data-approved="{"1" if n["approved"] else "0"}" '
            f'data-draining="{"1" if n["draining"] else "0"}"'
            f"{_STALE_CLASS if n['stale'] else ''}>\n",
            f'  <td class="id"><a href="{url}">{node_id}</a>',
            f"<br><small>{_e(name)}</small>" if name else "",
            f'<br><small class="labels">{_e(n["labels"])}</small>' if n["labels"] else "",
            "</td>\n",
            f'  <td class="state"><span class="badge s-{state}">{state}</span>',
            ' <span class="badge chip">Draining</span>' if n["draining"] else "",
            maintenance,
            f'<div class="reasons">{_e(n["reasons"])}</div>',
            (
                f'<div class="last-error error" title="{_e(error)}">'
                f"{_e(truncatechars(error, 120))}</div>"
                if error
                else ""
            ),
            "</td>\n",
            f'  <td class="address"><code>{_e(n["address"])}</code><br><small class="os">'
            f"{_e(n['os_arch']) if n['os_arch'] else _DASH}</small></td>\n",
            '  <td class="cpu">',
            (
                f'<meter min="0" max="100" value="{_e(cpu)}"></meter> {_e(cpu)} %'
                if cpu is not None
                else _DASH
            ),
            "</td>\n",
            f'  <td class="ram">{_bar_html(n["mem_bar"])}</td>\n',
            f'  <td class="gpus">{_gpus_html(n["gpus"])}</td>\n',
            f'  <td class="models">{_e(n["models_text"])}</td>\n',
            f'  <td class="agent">{_e(n["agent_version"]) if n["agent_version"] else _DASH}'
            f"{_e(n['protocol_text'])}</td>\n",
            f'  <td class="cert">{_cert_html(n["certificate"])}</td>\n',
            f'  <td class="operations">{_operations_html(n["operations"])}</td>\n',
            f'  <td class="seen">{_e(n["last_seen_age"])}',
            f"<br><small>values as of {_e(seen)}</small>" if n["stale"] and seen else "",
            "</td>\n",
            '  <td class="actions">\n    ',
            _actions_html(n, url, csrf),
            "\n  </td>\n</tr>\n",
        )
    )


def rows_html(rows: list[dict[str, Any]], csrf: str) -> SafeString:
    """The table's rows (each followed by its indent); empty for no rows (nodes_table.html
    writes its empty row then)."""
    return SafeString("".join(row_html(n, csrf) + "\n  " for n in rows))


def table_context(request: HttpRequest, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What nodes_table.html takes for ``rows`` (the Nodes page's, the Overview's)."""
    # One token for the page (the context processor's would be masked anew per render).
    token = get_token(request)
    return {"nodes": rows, "rows_html": rows_html(rows, csrf_input(token)), "csrf_token": token}
