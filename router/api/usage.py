"""/api/usage (JSON summary per key and model) and /api/usage.csv (hourly rows)."""

from __future__ import annotations

from typing import Any

from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from core.api_negotiation import AnyAccept
from core.api_serializers import INT_OR_EMPTY, errors
from router import usage
from router.api.serializers import UsageSummarySerializer, usage_items

_RANGE = [
    OpenApiParameter("from", OpenApiTypes.STR, description="A date or an ISO 8601 time."),
    OpenApiParameter("to", OpenApiTypes.STR, description="A date or an ISO 8601 time."),
    OpenApiParameter("key", INT_OR_EMPTY, description="Only this key's id."),
    OpenApiParameter("model", OpenApiTypes.STR, description="Only this served name."),
]


def _query(request: Request) -> dict[str, Any]:
    params = request.query_params
    start, end = usage.parse_range(params.get("from"), params.get("to"))
    return {
        "start": start,
        "end": end,
        "key_id": usage.parse_key_id(params.get("key")),
        "model": params.get("model") or None,
    }


# GenericAPIView[Any]: no queryset, no model; the generic view is there for the
# schema (serializer_class, parameters), and its rows are dicts, not model rows.
@extend_schema(tags=["usage"])
class UsageSummary(GenericAPIView[Any]):
    serializer_class = UsageSummarySerializer

    @extend_schema(parameters=_RANGE, responses={200: UsageSummarySerializer, **errors(400)})
    def get(self, request: Request) -> Response:
        query = _query(request)
        rows = usage.usage_summary(**query)
        items = usage_items(rows)  # UsageRowSerializer's rows (the schema), written out
        totals = {
            name: sum(item[name] for item in items)
            for name in ("requests", "promptTokens", "completionTokens", "totalTokens", "errors")
        }
        return Response(
            {
                "from": query["start"].isoformat(),
                "to": query["end"].isoformat(),
                "usage": items,
                "totals": totals,
            }
        )


@extend_schema(tags=["usage"])
class UsageCsv(GenericAPIView[Any]):
    content_negotiation_class = AnyAccept

    @extend_schema(
        parameters=_RANGE,
        responses={
            (200, "text/csv"): OpenApiResponse(OpenApiTypes.BINARY, description="Hourly rows."),
            **errors(400),
        },
    )
    def get(self, request: Request) -> StreamingHttpResponse:
        query = _query(request)
        # Under ASGI the rows are read batch by batch in the sync thread; the sync
        # iterator serves WSGI and the test client without buffering either.
        content = (
            usage.ausage_csv(**query)
            if isinstance(request._request, ASGIRequest)
            else usage.usage_csv(**query)
        )
        response = StreamingHttpResponse(content, content_type="text/csv; charset=utf-8")
        name = f"usage-{query['start']:%Y%m%dT%H%M}-{query['end']:%Y%m%dT%H%M}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
