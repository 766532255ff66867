"""Console pages (thin: they read services and the status cache)."""

from __future__ import annotations

import datetime
from collections.abc import Callable

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Prefetch
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from core import supervision
from core.errors import ServiceError
from models_registry import lifecycle
from models_registry import services as model_services
from models_registry.models import ModelDefinition
from nodes import events, rotation, services, status_cache
from nodes import status as node_status
from nodes.models import AuditEvent, CertRotation, Node
from nodes.status_cache import NodeStatus

PageView = Callable[..., HttpResponse]
operator_required: Callable[[PageView], PageView] = staff_member_required(login_url="/login/")


def _gib(value: object) -> float | None:
    return value / 2**30 if isinstance(value, int | float) else None


@operator_required
def overview(request: HttpRequest) -> HttpResponse:
    open_rotations = Prefetch(
        "rotations", queryset=CertRotation.objects.filter(open=True), to_attr="open_rotations"
    )
    nodes = list(Node.objects.prefetch_related(open_rotations))
    models = list(ModelDefinition.objects.prefetch_related("placements__node"))
    statuses = node_status.read_many(
        [*nodes, *(p.node for m in models for p in m.placements.all())]
    )
    node_rows = [
        _node_row(
            node, statuses[node.node_id], node.open_rotations[0] if node.open_rotations else None
        )
        for node in nodes
    ]
    model_rows = [_model_row(model, statuses) for model in models]
    download_rows = [
        {"node_id": node_id, **download_row(d)}
        for node_id, status in sorted(statuses.items())
        for d in ((status or {}).get("downloads") or {}).values()
    ]
    blocked = any(row["state"] == "PendingTakeover" for row in node_rows)
    stale, as_of = status_cache.oldest_as_of(statuses)
    return render(
        request,
        "console/overview.html",
        {
            "nodes": node_rows,
            "models": model_rows,
            "downloads": download_rows,
            "takeover_needed": blocked,
            "redis_unreachable": stale,
            "statuses_as_of": _utc(as_of),
            "restarts": supervision.restart_lines(settings.MIRBAD.run_dir),
        },
    )


def _node_row(
    node: Node, status: NodeStatus, open_rotation: CertRotation | None
) -> dict[str, object]:
    """One node as the Overview's row and the node page show it."""
    memory = (status.get("telemetry") or {}).get("memory") or {}
    return {
        "node_id": node.node_id,
        "state": node_status.state_of(status),
        "approved": node.approved,
        "revoked": node.revoked,
        "draining": node.draining,
        "maintenance_until": node.maintenance_until if node.maintenance_left() else None,
        "maintenance_reason": node.maintenance_reason,
        "fingerprint": f"SHA256:{node.spki_pin}" if node.spki_pin else "",
        "certificate": _certificate(rotation.certificate_summary(node, open_rotation)),
        "reasons": ", ".join(r.get("code", "") for r in status.get("reasons", [])),
        "cpu": (status.get("telemetry") or {}).get("cpuPercent"),
        "mem_percent": memory.get("percent"),
        "mem_used_gib": _gib(memory.get("usedBytes")),
        "mem_total_gib": _gib(memory.get("totalBytes")),
    }


def _certificate(summary: events.CertificateSummary) -> dict[str, object]:
    """The summary with its times as the page prints them (live.js prints the same)."""
    return {
        **summary,
        "not_after": _when(summary["notAfter"]),
        "renew_at": _when(summary["renewAt"]),
    }


def _when(iso: str | None) -> str:
    """'2026-12-02 18:35 UTC' (the console's one way to print a time)."""
    return f"{iso[:10]} {iso[11:16]} UTC" if iso else ""


@operator_required
def node_page(request: HttpRequest, node_id: str) -> HttpResponse:
    """One node: its state, certificate and open rotation (live), its rotations and
    audit events, its actions."""
    node = Node.objects.filter(node_id=node_id).first()
    if node is None:
        raise Http404(f"No node '{node_id}'.")
    status = node_status.read(node)
    active = CertRotation.objects.filter(node=node, open=True).first()
    return render(
        request,
        "console/node.html",
        {
            "n": _node_row(node, status, active),
            "address": node.address,
            "rotations": CertRotation.objects.filter(node=node).order_by("-created_at")[:10],
            "audit": AuditEvent.objects.filter(node_id=node.node_id).order_by("-at")[:25],
        },
    )


def _utc(moment: float | None) -> datetime.datetime | None:
    return datetime.datetime.fromtimestamp(moment, datetime.UTC) if moment is not None else None


def _model_row(model: ModelDefinition, statuses: dict[str, NodeStatus]) -> dict[str, object]:
    """One model line: the row model.updated also carries, the budget, notes."""
    summary = model_services.model_summary(model, statuses)
    budget = model.memory_budget_bytes or (model.estimate or {}).get("budgetBytes")
    notes = []
    for placement in model.placements.all():
        status = statuses.get(placement.node.node_id) or {}
        inst = (status.get("instances") or {}).get(placement.instance_id)
        if not inst:
            continue
        value = (inst.get("measured") or {}).get("bytes")
        if isinstance(value, int):
            flag = lifecycle.over_budget_text(budget, value)
            if flag:
                notes.append(f"{placement.node.node_id}: {flag}")
        if lifecycle.restart_pending(model, placement, inst):
            notes.append(f"{placement.node.node_id}: restart pending")
    if model.auto_start_note:
        notes.append(model.auto_start_note)
    return {
        "id": model.pk,
        "served_name": model.served_name,
        "state": summary["state"],
        "node_id": summary["nodeId"] or "-",
        "error": summary["error"] or "",
        "budget_gib": _gib(budget),
        "measured_gib": _gib(summary["measuredBytes"]),
        "restarts": summary["restartCount"],
        "notes": "; ".join(notes),
    }


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


@operator_required
def add_node(request: HttpRequest) -> HttpResponse:
    """Add node: a single-use join token, shown once, with the command to run."""
    context: dict[str, object] = {}
    if request.method == "POST":
        try:
            context["join"] = services.create_join_token(
                node_id=request.POST.get("node_id", "").strip()
            )
        except ServiceError as exc:
            context["error"] = exc.message
            context["node_id"] = request.POST.get("node_id", "")
    elif request.method != "GET":
        return HttpResponseNotAllowed(["GET", "POST"])
    return render(request, "console/add_node.html", context)


@operator_required
@require_POST
def node_action(request: HttpRequest, node_id: str, action: str) -> HttpResponse:
    try:
        if action == "approve":
            services.approve_node(node_id)
        elif action == "revoke":
            services.revoke_node(node_id)
        elif action in ("drain", "undrain"):
            services.set_draining(node_id, action == "drain")
        elif action == "rotate":
            rotation.rotate_now(node_id, actor=str(request.user))  # two-phase, in Celery
        else:
            return HttpResponse(status=404)
    except ServiceError as exc:
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
    if request.POST.get("back") == "node":
        return redirect("node", node_id=node_id)  # the form on the node page
    return redirect("overview")


@operator_required
@require_POST
def takeover(request: HttpRequest) -> HttpResponse:
    services.takeover()
    return redirect("overview")


@operator_required
@require_POST
def rekey_node(request: HttpRequest, node_id: str) -> HttpResponse:
    """Rekey: a single-use token for a node whose identity was lost; engines keep running."""
    try:
        join = services.rekey_node(node_id)
    except ServiceError as exc:
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
    return render(request, "console/add_node.html", {"join": join, "rekey": True})
