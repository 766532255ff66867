"""/api/models: definitions, placement, start and stop (thin; services decide)."""

from __future__ import annotations

from typing import Any

from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ServiceError
from models_registry import lifecycle, services, suggest
from models_registry.models import ModelDefinition, Placement
from nodes import status_cache


def placement_json(
    model: ModelDefinition, placement: Placement, statuses: dict[str, Any]
) -> dict[str, Any]:
    status = statuses.get(placement.node.node_id) or {}
    inst = (status.get("instances") or {}).get(placement.instance_id)
    measured = (inst or {}).get("measured")
    budget = model.memory_budget_bytes or (model.estimate or {}).get("budgetBytes")
    return {
        "node": placement.node.node_id,
        "instanceId": placement.instance_id,
        "gpuUuids": placement.gpu_uuids,
        "gpuBudgets": placement.gpu_budgets,
        "state": (inst or {}).get("state") if inst else "Stopped",
        "restartCount": (inst or {}).get("restartCount", 0),
        "restartPending": lifecycle.restart_pending(model, placement, inst),
        "measured": measured,
        "overBudget": lifecycle.over_budget_text(
            budget, measured.get("bytes") if isinstance(measured, dict) else None
        ),
        "error": (inst or {}).get("error"),
    }


def model_json(model: ModelDefinition, statuses: dict[str, Any]) -> dict[str, Any]:
    state = services.model_state(model, statuses)
    return {
        "id": model.pk,
        "servedName": model.served_name,
        "runtime": model.runtime,
        "delivery": model.delivery,
        "sourceFolder": model.source_folder,
        "sourceFile": model.source_file,
        "settings": model.settings,
        "autoStart": model.auto_start,
        "autoStartNote": model.auto_start_note or None,
        "desiredState": model.desired_state,
        "memoryBudgetBytes": model.memory_budget_bytes,
        "estimate": model.estimate or None,
        "placements": [placement_json(model, p, statuses) for p in model.placements.all()],
        "state": state["state"],
        "nodeId": state["nodeId"],
        "error": state["error"],
    }


def _statuses(models: list[ModelDefinition]) -> dict[str, Any]:
    node_ids = sorted({p.node.node_id for m in models for p in m.placements.all()})
    return status_cache.read_many(node_ids)


def _body(request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise ServiceError(400, "invalid_request", "The body must be a JSON object.")
    return dict(request.data)


# The API speaks camelCase; services use the model's field names.
_FIELDS = {
    "servedName": "served_name",
    "sourceFolder": "source_folder",
    "sourceFile": "source_file",
    "autoStart": "auto_start",
    "runtime": "runtime",
    "settings": "settings",
    "node": "node",
    "placements": "placements",
    "memoryBudgetBytes": "memory_budget_bytes",
}


def _translate(body: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise ServiceError(
            400,
            "invalid_request",
            f"{unknown[0]}: unknown field; known fields are {', '.join(sorted(_FIELDS))}",
        )
    return {_FIELDS[k]: v for k, v in body.items()}


class ModelList(APIView):
    def get(self, request: Request) -> Response:
        models = list(ModelDefinition.objects.prefetch_related("placements__node"))
        statuses = _statuses(models)
        return Response({"models": [model_json(m, statuses) for m in models]})

    def post(self, request: Request) -> Response:
        model = services.create_model(_translate(_body(request)))
        return Response(model_json(model, _statuses([model])), status=status.HTTP_201_CREATED)


class ModelDetail(APIView):
    def get(self, request: Request, model_id: int) -> Response:
        model = services.get_model(model_id)
        return Response(model_json(model, _statuses([model])))

    def patch(self, request: Request, model_id: int) -> Response:
        model = services.update_model(services.get_model(model_id), _translate(_body(request)))
        return Response(model_json(model, _statuses([model])))

    def delete(self, request: Request, model_id: int) -> Response:
        model = services.get_model(model_id)
        if model.desired_state == "running":
            raise ServiceError(409, "model_running", "Stop the model before deleting it.")
        model.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


def _command_options(request: Request) -> dict[str, Any]:
    """``force`` and ``node`` from the body (or the query string) of start/restart/stop."""
    body = request.data if isinstance(request.data, dict) else {}
    unknown = sorted(set(body) - {"force", "node"})
    if unknown:
        raise ServiceError(
            400, "invalid_request", f"{unknown[0]}: unknown field; known fields are force, node"
        )
    force = body.get("force", request.query_params.get("force") in ("1", "true"))
    if not isinstance(force, bool):
        raise ServiceError(400, "invalid_request", "force: must be true or false")
    node = body.get("node", request.query_params.get("node"))
    if node is not None and not isinstance(node, str):
        raise ServiceError(400, "invalid_request", "node: must be a node id")
    return {"force": force, "node_id": node}


class ModelStart(APIView):
    def post(self, request: Request, model_id: int) -> Response:
        options = _command_options(request)
        return Response(lifecycle.start_model(model_id, **options), status=202)


class ModelRestart(APIView):
    def post(self, request: Request, model_id: int) -> Response:
        options = _command_options(request)
        return Response(lifecycle.restart_model(model_id, **options), status=202)


class ModelStop(APIView):
    def post(self, request: Request, model_id: int) -> Response:
        options = _command_options(request)
        if options["force"]:
            raise ServiceError(400, "invalid_request", "force: applies to start and restart only")
        return Response(lifecycle.stop_model(model_id, node_id=options["node_id"]))


class ModelEstimate(APIView):
    """GET /api/models/{id}/estimate[?node=]: the breakdown and the admission lines."""

    def get(self, request: Request, model_id: int) -> Response:
        return Response(
            lifecycle.model_estimate(model_id, node_id=request.query_params.get("node"))
        )


class PlacementSuggestions(APIView):
    def get(self, request: Request, model_id: int) -> Response:
        return Response(suggest.suggest_placements(model_id))


class EstimateAccuracy(APIView):
    """GET /api/estimate-accuracy: measured / budget per architecture and quantisation."""

    def get(self, request: Request) -> Response:
        return Response({"groups": lifecycle.estimate_accuracy()})
