"""Console pages (thin: they read services and the status cache)."""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from mirbad_site.errors import ServiceError
from models_registry import services as model_services
from models_registry.models import ModelDefinition
from nodes import services, status_cache
from nodes.models import Node
from nodes.states import registry_state

operator_required = staff_member_required(login_url="/login/")


def _gib(value: object) -> float | None:
    return value / 2**30 if isinstance(value, int | float) else None


@operator_required
def overview(request: HttpRequest) -> HttpResponse:
    nodes = list(Node.objects.all())
    models = list(ModelDefinition.objects.prefetch_related("placements__node"))
    statuses = status_cache.read_many(
        sorted(
            {n.node_id for n in nodes}
            | {p.node.node_id for m in models for p in m.placements.all()}
        )
    )
    node_rows = []
    for node in nodes:
        status = statuses.get(node.node_id) or {}
        memory = (status.get("telemetry") or {}).get("memory") or {}
        fixed = registry_state(approved=node.approved, revoked=node.revoked)
        node_rows.append(
            {
                "node_id": node.node_id,
                "state": fixed.value if fixed else status.get("state", "Offline"),
                "approved": node.approved,
                "revoked": node.revoked,
                "draining": node.draining,
                "fingerprint": f"SHA256:{node.spki_pin}" if node.spki_pin else "",
                "reasons": ", ".join(r.get("code", "") for r in status.get("reasons", [])),
                "cpu": (status.get("telemetry") or {}).get("cpuPercent"),
                "mem_percent": memory.get("percent"),
                "mem_used_gib": _gib(memory.get("usedBytes")),
                "mem_total_gib": _gib(memory.get("totalBytes")),
            }
        )
    model_rows = []
    for model in models:
        state = model_services.model_state(model, statuses)
        model_rows.append(
            {
                "id": model.pk,
                "served_name": model.served_name,
                "state": state["state"],
                "node_id": state["nodeId"] or "-",
                "error": state["error"] or "",
            }
        )
    blocked = any(row["state"] == "PendingTakeover" for row in node_rows)
    return render(
        request,
        "console/overview.html",
        {"nodes": node_rows, "models": model_rows, "takeover_needed": blocked},
    )


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
            node = services.approve_node(node_id)
        elif action == "revoke":
            node = services.revoke_node(node_id)
        elif action in ("drain", "undrain"):
            node = services.set_draining(node_id, action == "drain")
        else:
            return HttpResponse(status=404)
    except ServiceError as exc:
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
    services.announce(node)
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
