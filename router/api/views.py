"""/api/keys: create (shown once), list, change, revoke (thin; router.keys decides)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from core.api_serializers import errors, parse
from core.errors import ServiceError
from router import budgets, keys
from router.api.serializers import (
    KeyListSerializer,
    KeySerializer,
    KeyWriteSerializer,
    NewKeySerializer,
)
from router.models import ApiKey

DEFAULT_SCOPES = ["chat", "completions", "embeddings", "rerank"]


def _refusal(exc: keys.KeyError_) -> ServiceError:
    """The service names its field; say it as the API spells it."""
    name = KeyWriteSerializer.api_name(exc.field)
    return ServiceError(400, "invalid_request", f"{name}: {exc.reason}")


@extend_schema(tags=["keys"])
class KeyViewSet(viewsets.GenericViewSet[ApiKey]):
    queryset = ApiKey.objects.all()
    serializer_class = KeySerializer
    lookup_url_kwarg = "key_id"

    @extend_schema(responses={200: KeyListSerializer})
    def list(self, request: Request) -> Response:
        rows = list(ApiKey.objects.all())
        context = {"budgets": budgets.status(rows)}  # one read per zone, not per key
        # many=True takes a list; the stubs type the argument as one ApiKey.
        listed = KeySerializer(rows, many=True, context=context)  # type: ignore[arg-type]
        return Response({"keys": listed.data})

    @extend_schema(request=KeyWriteSerializer, responses={201: NewKeySerializer, **errors(400)})
    def create(self, request: Request) -> Response:
        fields = parse(KeyWriteSerializer, request.data)
        fields.setdefault("scopes", DEFAULT_SCOPES)
        fields.setdefault("name", None)
        try:
            row, key = keys.create_key(**fields)
        except keys.KeyError_ as exc:
            raise _refusal(exc) from None
        row.key = key  # type: ignore[attr-defined]  # shown this once, never stored
        return Response(NewKeySerializer(row).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=KeyWriteSerializer, responses={200: KeySerializer, **errors(400, 404)})
    def partial_update(self, request: Request, key_id: int) -> Response:
        changes = parse(KeyWriteSerializer, request.data)
        try:
            row = keys.update_key(key_id, changes)
        except keys.KeyNotFound as exc:
            raise ServiceError(404, "not_found", str(exc)) from None
        except keys.KeyError_ as exc:
            raise _refusal(exc) from None
        return Response(KeySerializer(row).data)

    @extend_schema(responses={204: None, **errors(404)})
    def destroy(self, request: Request, key_id: int) -> Response:
        try:
            keys.revoke_key(key_id)
        except keys.KeyNotFound as exc:
            raise ServiceError(404, "not_found", str(exc)) from None
        return Response(status=status.HTTP_204_NO_CONTENT)
