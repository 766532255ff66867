"""Console pages (thin: they read services and the status cache)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from models_registry import services as model_services
from models_registry.models import ModelDefinition
from nodes import status_cache
from nodes.models import Node


def _gib(value: object) -> float | None:
    return value / 2**30 if isinstance(value, int | float) else None


@login_required
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
        node_rows.append(
            {
                "node_id": node.node_id,
                "state": status.get("state", "Offline"),
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
    return render(request, "console/overview.html", {"nodes": node_rows, "models": model_rows})
