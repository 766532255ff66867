"""The Models list, one model's row and page, its actions and the editor's live estimate
(thin: they read models_registry's services and the status cache; docs/operator-guide.md
"Models in the console"). The editor itself is console/model_editor.py."""

from __future__ import annotations

import json
from typing import Any, Literal

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from console import pager
from console.access import operator_required
from console.formats import gib
from core import paging
from core.errors import ServiceError
from core.jsoninput import JSON_ERRORS, NOT_TEXT, first_non_text, why_not_json
from models_registry import drafts, kpis, lifecycle, listing, services
from models_registry.models import ModelDefinition
from nodes import status as node_status
from nodes.status_cache import NodeStatus
from router import queue as fair_queue

ACTIONS = ("start", "stop", "restart", "delete")
# The KPIs the page shows from the newest point of kpis.model_series (None: shown as a dash).
KPI_KEYS = ("running", "waiting", "promptTps", "genTps", "prefixHit")


def _latest(model: ModelDefinition) -> dict[str, Any]:
    """The model's current KPIs over its replicas, {} when none reports them."""
    return dict(kpis.latest_many([model]).get(model.pk) or {})


def model_row(
    model: ModelDefinition,
    statuses: dict[str, NodeStatus],
    flags: dict[int, Any],
    latest: dict[str, Any],
    queued: tuple[int, float | None] | None = None,
) -> dict[str, Any]:
    """One model as the list and its row fragment render it.

    The cells ``model.updated`` carries (name, state, node, error, measured,
    restarts) come from ``services.model_summary``, the function the event is built
    with, so a live row shows what a reload would (docs/decisions.md D65).
    """
    summary = services.model_summary(model, statuses)
    budget = model.memory_budget_bytes or (model.estimate or {}).get("budgetBytes")
    pending, over = [], []
    for placement in model.placements.all():
        node_id = placement.node.node_id
        inst = ((statuses.get(node_id) or {}).get("instances") or {}).get(placement.instance_id)
        if lifecycle.restart_pending(model, placement, inst):
            pending.append(node_id)
        measured = ((inst or {}).get("measured") or {}).get("bytes")
        text = lifecycle.over_budget_text(budget, measured if isinstance(measured, int) else None)
        if text:
            over.append(f"{node_id}: {text}")
    flag = flags.get(model.pk) or {}
    return {
        "id": model.pk,
        # The model's page; its actions and editor are below it (console/urls.py), so a
        # row of 500 reverses one URL, not six.
        "url": reverse("model", args=[model.pk]),
        "served_name": summary["servedName"],
        "state": summary["state"],
        "node_id": summary["nodeId"] or "-",
        "error": summary["error"] or "",
        "nodes": [p.node.node_id for p in model.placements.all()],
        # Fields of the row itself: no query per row.
        "runtime": model.get_runtime_display(),
        "delivery": model.delivery,
        "image": model.image if model.delivery == ModelDefinition.Delivery.CONTAINER else "",
        "budget_gib": gib(budget),
        "budget_manual": bool(model.memory_budget_bytes),
        "measured_gib": gib(summary["measuredBytes"]),
        "restarts": summary["restartCount"],
        "restart_pending": pending,
        "over_budget": over,
        "stalled": bool(flag.get("stalled")),
        "slow": bool(flag.get("slow")),
        "flag_reason": flag.get("reason") or "",
        "running": latest.get("running"),
        "waiting": latest.get("waiting"),
        # The router's fair queue (router.queue): waiting now, and the latest wait.
        "queued": queued[0] if queued else 0,
        "queue_wait_ms": queued[1] if queued else None,
        "desired": model.desired_state,
        "auto_start_note": model.auto_start_note,
    }


def _rows(models: list[ModelDefinition]) -> list[dict[str, Any]]:
    statuses = node_status.read_many(p.node for m in models for p in m.placements.all())
    flags = kpis.model_flags(models)
    latest = kpis.latest_many(models)
    queues = fair_queue.snapshot([m.served_name for m in models])
    return [
        model_row(m, statuses, flags, dict(latest.get(m.pk) or {}), queues.get(m.served_name))
        for m in models
    ]


def _get(model_id: int) -> ModelDefinition:
    model = ModelDefinition.objects.prefetch_related("placements__node").filter(pk=model_id).first()
    if model is None:
        raise Http404(f"No model {model_id}.")
    return model


@operator_required
def models_list(request: HttpRequest) -> HttpResponse:
    """The models with their state, nodes, budget and measured memory, flags, queue and
    actions, a page of ``core.paging.PAGE_SIZE`` at a time; search, filters and the page
    are GET parameters (``q``, ``state``, ``node``, ``page``; models_registry.listing)."""
    context: dict[str, Any] = {
        "states": listing.STATES,
        "q": request.GET.get("q", "").strip()[:100],
        "state": request.GET.get("state", "")[:200],
        "node": request.GET.get("node", "").strip()[:40],
        "models": [],
    }
    try:
        # A long search is cut, as the box cuts it, rather than refused.
        params = request.GET.copy()
        params["q"] = context["q"]
        wanted = listing.parse_filter(params, search_name="q")
        number = paging.page_number(request.GET)
        found = listing.select(wanted, paging.Page(number=number, pages=number).window)
        page = paging.console_page(number, found.count)
        if page.number != number:  # past the last page (a shared link, fewer models now)
            found = listing.select(wanted, page.window)
    except ServiceError as exc:
        context["notice"] = exc.message
        return render(request, "console/models.html", context, status=exc.status)
    context.update(
        models=_rows(found.models),
        total=found.total,
        filtered=wanted.active or page.number > 1,
        pager=pager.links(request.GET, page, found.count),
    )
    return render(request, "console/models.html", context)


@operator_required
def model_row_fragment(request: HttpRequest, model_id: int) -> HttpResponse:
    """One ``<tr>`` exactly as the list renders it: models.js swaps it in after a
    ``model.updated`` event, so the cells the event does not carry are current too."""
    return render(request, "console/model_row.html", {"m": _rows([_get(model_id)])[0]})


def _replicas(model: ModelDefinition, statuses: dict[str, NodeStatus]) -> list[dict[str, Any]]:
    budget = model.memory_budget_bytes or (model.estimate or {}).get("budgetBytes")
    out = []
    for placement in model.placements.all():
        node = placement.node
        status = statuses.get(node.node_id) or {}
        inst = (status.get("instances") or {}).get(placement.instance_id)
        measured = ((inst or {}).get("measured") or {}).get("bytes")
        serving = node_status.is_serving(status)
        out.append(
            {
                "node_id": node.node_id,
                "node_state": node_status.state_of(status),
                "instance_id": placement.instance_id,
                # The short form docker ps prints; a process instance has none.
                "container_id": str((inst or {}).get("containerId") or "")[:12],
                "gpus": ", ".join(placement.gpu_uuids) or "host memory",
                "state": (inst or {}).get("state", "Stopped") if serving else "Offline",
                "measured_gib": gib(measured),
                "over_budget": lifecycle.over_budget_text(
                    budget, measured if isinstance(measured, int) else None
                ),
                "restarts": int((inst or {}).get("restartCount") or 0),
                "restart_pending": lifecycle.restart_pending(model, placement, inst),
                "error": (inst or {}).get("error") or "",
            }
        )
    return out


BREAKDOWN = (
    ("weights", "Weights"),
    ("kv", "KV cache"),
    ("ssm_state", "SSM state"),
    ("compute", "Compute buffer"),
    ("cuda_context", "CUDA context"),
    ("budget", "Budget (x 1.10, with the CUDA context)"),
)


def _breakdown(saved: dict[str, Any]) -> list[tuple[str, float | None]]:
    """The last stored estimate's parts in GiB, in the order editor.js shows them."""
    return [(label, gib(saved.get(key))) for key, label in BREAKDOWN] if saved else []


@operator_required
def model_page(request: HttpRequest, model_id: int) -> HttpResponse:
    """One model: state and cause, replicas, KPIs, charts, its engines' logs, actions."""
    model = _get(model_id)
    statuses = node_status.read_many(p.node for p in model.placements.all())
    latest = _latest(model)
    queued = fair_queue.snapshot([model.served_name]).get(model.served_name)
    row = model_row(model, statuses, kpis.model_flags([model]), latest, queued)
    replicas = _replicas(model, statuses)
    return render(
        request,
        "console/model.html",
        {
            "m": row,
            "model": model,
            "replicas": replicas,
            "kpis": {key: latest.get(key) for key in KPI_KEYS},
            "estimate": _breakdown((model.estimate or {}).get("breakdown") or {}),
            "first_replica": replicas[0] if replicas else None,
        },
    )


@operator_required
@require_POST
def model_action(request: HttpRequest, model_id: int, action: str) -> HttpResponse:
    """Start, stop, restart or delete through the lifecycle and services, then back
    to the page the form was on (post/redirect/get); a refusal is the next page's message."""
    if action not in ACTIONS:
        raise Http404(f"No action '{action}'.")
    back_to_page = request.POST.get("back") == "model" and action != "delete"
    force = request.POST.get("force") == "1" and action in ("start", "restart")
    try:
        if action == "delete":
            model = services.get_model(model_id)
            services.delete_model(model)
            messages.success(request, f"Deleted model '{model.served_name}'.")
        elif action == "stop":
            done = lifecycle.stop_model(model_id)
            messages.success(request, f"Stopped '{done['servedName']}'.")
        else:
            run = lifecycle.start_model if action == "start" else lifecycle.restart_model
            done = run(model_id, force=force)
            count = len(done["instances"])
            what = "Start" if action == "start" else "Restart"
            messages.success(request, f"{what} of '{done['servedName']}' sent to {count} node(s).")
    except ServiceError as exc:
        messages.error(request, exc.message)
    if back_to_page:
        return redirect("model", model_id=model_id)
    return redirect("models")


def _refuse(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(ServiceError(status, code, message).as_json(), status=status)


@operator_required
@require_POST
def model_estimate(request: HttpRequest) -> JsonResponse:
    """POST /models/estimate/: the editor's unsaved form as JSON; answers the breakdown and
    one admission line per GPU (models_registry.drafts), or 400 naming what is wrong."""
    try:
        body = json.loads(request.body)
    except JSON_ERRORS as exc:
        return _refuse(400, "invalid_json", f"The body is not JSON: {why_not_json(exc)}.")
    bad = first_non_text(body)
    if bad is not None:
        return _refuse(400, "invalid_request", f"{bad}: {NOT_TEXT}")
    try:
        return JsonResponse(drafts.draft_estimate(body))
    except ServiceError as exc:
        return JsonResponse(exc.as_json(), status=exc.status)


@operator_required
def model_history(request: HttpRequest, model_id: int) -> HttpResponse:
    """The model's KPI points for its charts (``window`` 1h or 24h), oldest first."""
    raw = request.GET.get("window", "1h")
    if raw not in ("1h", "24h"):
        return _refuse(400, "invalid_request", "window: one of 1h, 24h.")
    window: Literal["1h", "24h"] = "24h" if raw == "24h" else "1h"
    model = _get(model_id)
    return JsonResponse(
        {"modelId": model.pk, "window": window, "points": kpis.model_series(model, window)}
    )
