"""Console page for routes, aliases with fallbacks (thin: the rules are models_registry.routes)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from console.access import operator_required
from core.errors import ServiceError
from models_registry import routes
from models_registry.models import ModelDefinition


def _targets(text: str) -> list[str]:
    """One served name a line (commas work too), first preferred; blanks dropped."""
    return [t.strip() for line in text.splitlines() for t in line.split(",") if t.strip()]


def _page(request: HttpRequest, *, status: int = 200, **context: Any) -> HttpResponse:
    context.setdefault("form", {"name": "", "targets": ""})
    context["routes"] = routes.list_routes()
    context["served_names"] = list(ModelDefinition.objects.values_list("served_name", flat=True))
    return render(request, "console/routes.html", context, status=status)


@operator_required
def routes_page(request: HttpRequest) -> HttpResponse:
    """List routes; a POST creates one (a refusal is shown at its field, with 400)."""
    if request.method == "GET":
        return _page(request)
    if request.method != "POST":
        return HttpResponseNotAllowed(["GET", "POST"])
    form = {"name": request.POST.get("name", ""), "targets": request.POST.get("targets", "")}
    try:
        row = routes.create_route(
            {"name": form["name"].strip(), "targets": _targets(form["targets"])}
        )
    except ServiceError as exc:
        error = {"field": exc.details.get("field", ""), "message": exc.message}
        return _page(request, status=400, form=form, error=error)
    messages.success(request, f"Route '{row.name}' created.")
    return redirect("routes")


@operator_required
@require_POST
def route_edit(request: HttpRequest, route_id: int) -> HttpResponse:
    """Rename a route or change its targets and their order."""
    try:
        row = routes.get_route(route_id)
        routes.update_route(
            row,
            {"name": request.POST.get("name", row.name).strip(),
             "targets": _targets(request.POST.get("targets", ""))},
        )  # fmt: skip
    except ServiceError as exc:
        error = {"field": exc.details.get("field", ""), "message": exc.message, "route": route_id}
        return _page(request, status=exc.status if exc.status == 404 else 400, error=error)
    messages.success(request, f"Route '{row.name}' saved.")
    return redirect("routes")


@operator_required
@require_POST
def route_delete(request: HttpRequest, route_id: int) -> HttpResponse:
    try:
        row = routes.get_route(route_id)
    except ServiceError as exc:
        return HttpResponse(exc.message, status=404, content_type="text/plain")
    routes.delete_route(row)
    messages.success(request, f"Route '{row.name}' deleted.")
    return redirect("routes")
