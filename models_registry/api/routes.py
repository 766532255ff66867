"""/api/routes: aliases with fallbacks (thin; models_registry.routes decides)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from core.api_serializers import ApiSerializer, IsoDateTime, JsonStr, JsonStrList, errors, parse
from models_registry import routes
from models_registry.models import Route


class RouteWriteSerializer(ApiSerializer):
    """POST /api/routes and PATCH /api/routes/{route}; the rules are the service's."""

    name = JsonStr(help_text="The name clients put in 'model'; a served name's rules.")
    targets = JsonStrList(help_text="1-16 distinct served names, the first preferred.")


class RouteSerializer(serializers.Serializer[Route]):
    """A route as listed."""

    id = serializers.IntegerField(source="pk")
    name = serializers.CharField()
    targets = serializers.ListField(child=serializers.CharField())
    createdAt = IsoDateTime(source="created_at")
    updatedAt = IsoDateTime(source="updated_at")


# many=False: the list action answers one object that holds the list, not a bare array.
@extend_schema_serializer(many=False)
class RouteListSerializer(serializers.Serializer[dict[str, Any]]):
    routes = RouteSerializer(many=True)


@extend_schema(tags=["routes"])
class RouteViewSet(viewsets.GenericViewSet[Route]):
    """Routes by name (or id): a stable ``model`` name with ordered fallbacks."""

    queryset = Route.objects.all()
    serializer_class = RouteSerializer
    lookup_url_kwarg = "route"

    @extend_schema(responses={200: RouteListSerializer})
    def list(self, request: Request) -> Response:
        rows = RouteSerializer(routes.list_routes(), many=True)  # type: ignore[arg-type]  # a list of rows
        return Response({"routes": rows.data})

    @extend_schema(
        request=RouteWriteSerializer, responses={201: RouteSerializer, **errors(400, 409)}
    )
    def create(self, request: Request) -> Response:
        row = routes.create_route(parse(RouteWriteSerializer, request.data))
        return Response(RouteSerializer(row).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: RouteSerializer, **errors(404)})
    def retrieve(self, request: Request, route: str) -> Response:
        return Response(RouteSerializer(routes.get_route(route)).data)

    @extend_schema(
        request=RouteWriteSerializer, responses={200: RouteSerializer, **errors(400, 404, 409)}
    )
    def partial_update(self, request: Request, route: str) -> Response:
        row = routes.update_route(
            routes.get_route(route), parse(RouteWriteSerializer, request.data)
        )
        return Response(RouteSerializer(row).data)

    @extend_schema(responses={204: None, **errors(404)})
    def destroy(self, request: Request, route: str) -> Response:
        routes.delete_route(routes.get_route(route))
        return Response(status=status.HTTP_204_NO_CONTENT)
