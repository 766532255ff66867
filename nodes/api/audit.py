"""/api/audit (a page of events, newest first) and /api/audit.csv (every match, streamed).

The filters and the page rule are nodes.audit's, shared with the console's Audit page.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from core.api_negotiation import AnyAccept
from core.api_serializers import INT_OR_EMPTY, IsoDateTime, errors
from nodes import audit

__all__ = ["AuditCsv", "AuditList"]

_FILTERS = [
    OpenApiParameter(
        "action", OpenApiTypes.STR, description="An action (login.failed) or a family (model)."
    ),
    OpenApiParameter("actor", OpenApiTypes.STR, description="Part of the actor's name."),
    OpenApiParameter("node", OpenApiTypes.STR, description="Only this node's events."),
    OpenApiParameter("from", OpenApiTypes.STR, description="A date or an ISO 8601 time."),
    OpenApiParameter(
        "to", OpenApiTypes.STR, description="A date (that day included) or an ISO 8601 time."
    ),
]
_PAGE = [
    OpenApiParameter("before", INT_OR_EMPTY, description="The `next` of the previous page."),
    OpenApiParameter("limit", INT_OR_EMPTY, description="1 to 1000; 100 by default."),
]


class AuditEventSerializer(serializers.Serializer):
    """One audit event (docs/operator-guide.md, "Audit log")."""

    id = serializers.IntegerField()
    at = IsoDateTime()
    actor = serializers.CharField(help_text="A user name, 'key mbd-… (#id)', a command, system.")
    # DRF's metaclass moves declared fields out of the class, so this never shadows
    # Field.source at run time; mypy only sees the class attribute.
    source = serializers.CharField(  # type: ignore[assignment]
        help_text="The peer address, 'local', or empty."
    )
    action = serializers.CharField()
    nodeId = serializers.CharField(source="node_id")
    subject = serializers.CharField()
    detail = serializers.DictField(help_text="What else was recorded; secrets masked.")


class AuditPageSerializer(serializers.Serializer):
    events = AuditEventSerializer(many=True)
    next = serializers.IntegerField(
        allow_null=True, help_text="Pass as `before` for the next page; null on the last."
    )


@extend_schema(tags=["audit"])
class AuditList(GenericAPIView[Any]):
    serializer_class = AuditPageSerializer

    @extend_schema(
        parameters=_FILTERS + _PAGE,
        responses={200: AuditPageSerializer, **errors(400)},
        description='Audit events, newest first (docs/operator-guide.md, "Audit log").',
    )
    def get(self, request: Request) -> Response:
        events, after = audit.page(audit.parse_filter(request.query_params))
        listed = AuditEventSerializer(events, many=True).data
        return Response({"events": listed, "next": after})


@extend_schema(tags=["audit"])
class AuditCsv(GenericAPIView[Any]):
    content_negotiation_class = AnyAccept

    @extend_schema(
        parameters=_FILTERS,
        responses={
            (200, "text/csv"): OpenApiResponse(
                OpenApiTypes.BINARY, description="Every matching event, newest first."
            ),
            **errors(400),
        },
    )
    def get(self, request: Request) -> StreamingHttpResponse:
        wanted = audit.parse_filter(request.query_params)
        # Under ASGI the batches are read in the sync thread; the sync iterator serves
        # WSGI and the test client; neither holds the whole export.
        asgi = isinstance(request._request, ASGIRequest)
        content = audit.acsv_lines(wanted) if asgi else audit.csv_lines(wanted)
        response = StreamingHttpResponse(content, content_type="text/csv; charset=utf-8")
        name = f"audit-{timezone.now():%Y%m%dT%H%M}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response


def csv_url(params: dict[str, str]) -> str:
    """The CSV link for the same filters (the console's export button)."""
    kept = {k: v for k, v in params.items() if k in ("action", "actor", "node", "from", "to") and v}
    return "/api/audit.csv" + ("?" + urlencode(kept) if kept else "")
