"""/api/models: definitions, placement, start and stop (thin; services decide)."""

from __future__ import annotations

from typing import Any

from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from mirbad_site.errors import ServiceError
from models_registry import services
from models_registry.models import ModelDefinition
from nodes import status_cache


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
        "desiredState": model.desired_state,
        "placements": [
            {"node": p.node.node_id, "instanceId": p.instance_id} for p in model.placements.all()
        ],
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


class ModelStart(APIView):
    def post(self, request: Request, model_id: int) -> Response:
        return Response(services.start_model(model_id), status=status.HTTP_202_ACCEPTED)


class ModelStop(APIView):
    def post(self, request: Request, model_id: int) -> Response:
        return Response(services.stop_model(model_id))
