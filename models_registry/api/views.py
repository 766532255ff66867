"""/api/models: definitions, placement, start and stop (thin; services decide)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from core import paging
from core.api_serializers import errors, parse
from core.errors import ServiceError
from models_registry import lifecycle, listing, services, suggest
from models_registry.api.serializers import (
    CommandResultSerializer,
    CommandSerializer,
    EstimateAccuracySerializer,
    ModelListSerializer,
    ModelSerializer,
    ModelWriteSerializer,
)
from models_registry.models import ModelDefinition
from nodes import status as node_status
from nodes.api.serializers import PAGE_PARAMETERS

_NODE_QUERY = OpenApiParameter(
    "node", OpenApiTypes.STR, description="Only this node's replica (also a body field)."
)
_FORCE_QUERY = OpenApiParameter(
    "force", OpenApiTypes.STR, description="'1' or 'true' skips the memory admission."
)
# What an operation that asks a node's agent can answer: the agent's refusals as
# models_registry.lifecycle.agent_error passes them on (400, 404, 409, 422, 501, 503,
# 504; any other is a 502), 503 for a node not serving, 504 for a lost answer.
AGENT_ERRORS = errors(400, 404, 409, 422, 501, 502, 503, 504)


def _statuses(models: list[ModelDefinition]) -> dict[str, Any]:
    return node_status.read_many(p.node for m in models for p in m.placements.all())


def _model_answer(model: ModelDefinition, status_code: int = 200) -> Response:
    # Read again with its placements and their nodes: the answer lists every replica,
    # and reading each one's node on its own was three queries a replica.
    model = ModelDefinition.objects.prefetch_related("placements__node").get(pk=model.pk)
    answer = ModelSerializer(model, context={"statuses": _statuses([model])})
    return Response(answer.data, status=status_code)


def _command_options(request: Request) -> dict[str, Any]:
    """``force`` and ``node`` from the body, or else from the query string."""
    body = parse(CommandSerializer, request.data)
    force = body.get("force", request.query_params.get("force") in ("1", "true"))
    node = body.get("node", request.query_params.get("node"))
    return {"force": force, "node_id": node}


@extend_schema(tags=["models"])
class ModelViewSet(viewsets.GenericViewSet):
    """Model definitions; start, restart and stop are actions (202 with the instances)."""

    queryset = ModelDefinition.objects.all()
    serializer_class = ModelSerializer
    lookup_url_kwarg = "model_id"

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "state",
                OpenApiTypes.STR,
                many=True,
                description="Only models in these states over their replicas (repeat it, or "
                f"a comma list): {', '.join(listing.STATES)}.",
            ),
            OpenApiParameter(
                "node", OpenApiTypes.STR, description="Only models with a replica on this node."
            ),
            OpenApiParameter(
                "search",
                OpenApiTypes.STR,
                description="A substring (any case) of the served name; at most 100 characters.",
            ),
            *PAGE_PARAMETERS,
        ],
        responses={200: ModelListSerializer, **errors(400)},
        description="Every model matching the filters, by served name (all of them up to "
        f"{paging.UNPAGED_MAX} without `limit`); `count` is how many match "
        '(docs/operator-guide.md, "Node and model lists").',
    )
    def list(self, request: Request) -> Response:
        wanted = listing.parse_filter(request.query_params)
        window = paging.window(request.query_params)
        found = listing.select(wanted, window)
        listed = ModelSerializer(
            found.models, many=True, context={"statuses": _statuses(found.models)}
        )
        return Response(
            {
                "models": listed.data,
                "count": found.count,
                "offset": window.offset,
                "limit": window.limit,
                "next": window.next_offset(found.count),
            }
        )

    @extend_schema(
        request=ModelWriteSerializer, responses={201: ModelSerializer, **errors(400, 404, 409)}
    )
    def create(self, request: Request) -> Response:
        model = services.create_model(parse(ModelWriteSerializer, request.data))
        return _model_answer(model, status.HTTP_201_CREATED)

    @extend_schema(responses={200: ModelSerializer, **errors(404)})
    def retrieve(self, request: Request, model_id: int) -> Response:
        return _model_answer(services.get_model(model_id))

    @extend_schema(
        request=ModelWriteSerializer, responses={200: ModelSerializer, **errors(400, 404, 409)}
    )
    def partial_update(self, request: Request, model_id: int) -> Response:
        model = services.get_model(model_id)
        return _model_answer(
            services.update_model(model, parse(ModelWriteSerializer, request.data))
        )

    @extend_schema(responses={204: None, **errors(404, 409)})
    def destroy(self, request: Request, model_id: int) -> Response:
        services.delete_model(services.get_model(model_id))
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        request=CommandSerializer,
        parameters=[_FORCE_QUERY, _NODE_QUERY],
        responses={202: CommandResultSerializer, **AGENT_ERRORS},
    )
    @action(detail=True, methods=["post"])
    def start(self, request: Request, model_id: int) -> Response:
        options = _command_options(request)
        return Response(lifecycle.start_model(model_id, **options), status=202)

    @extend_schema(
        request=CommandSerializer,
        parameters=[_FORCE_QUERY, _NODE_QUERY],
        responses={202: CommandResultSerializer, **AGENT_ERRORS},
    )
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, model_id: int) -> Response:
        options = _command_options(request)
        return Response(lifecycle.restart_model(model_id, **options), status=202)

    @extend_schema(
        request=CommandSerializer,
        parameters=[_NODE_QUERY],
        responses={200: CommandResultSerializer, **AGENT_ERRORS},
    )
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, model_id: int) -> Response:
        options = _command_options(request)
        if options["force"]:
            raise ServiceError(400, "invalid_request", "force: applies to start and restart only")
        return Response(lifecycle.stop_model(model_id, node_id=options["node_id"]))

    @extend_schema(
        parameters=[OpenApiParameter("node", OpenApiTypes.STR, description="Estimate there.")],
        responses={200: OpenApiTypes.OBJECT, **AGENT_ERRORS},
        description="The estimate's breakdown and the admission lines.",
    )
    @action(detail=True, methods=["get"])
    def estimate(self, request: Request, model_id: int) -> Response:
        return Response(
            lifecycle.model_estimate(model_id, node_id=request.query_params.get("node"))
        )

    @extend_schema(
        responses={200: OpenApiTypes.OBJECT, **errors(404)},
        description="Every node ranked for this model, with the reasons.",
    )
    @action(detail=True, methods=["get"], url_path="placement-suggestions")
    def placement_suggestions(self, request: Request, model_id: int) -> Response:
        return Response(suggest.suggest_placements(model_id))


@extend_schema(tags=["models"])
class EstimateAccuracyView(GenericAPIView):
    """GET /api/estimate-accuracy: measured / budget per architecture and quantisation."""

    serializer_class = EstimateAccuracySerializer

    def get(self, request: Request) -> Response:
        return Response({"groups": lifecycle.estimate_accuracy()})
