"""/api/usage (JSON summary per key and model) and /api/usage.csv (hourly rows)."""

from __future__ import annotations

from typing import Any

from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from router import usage


def _query(request: Request) -> dict[str, Any]:
    params = request.query_params
    start, end = usage.parse_range(params.get("from"), params.get("to"))
    return {
        "start": start,
        "end": end,
        "key_id": usage.parse_key_id(params.get("key")),
        "model": params.get("model") or None,
    }


class UsageSummary(APIView):
    def get(self, request: Request) -> Response:
        query = _query(request)
        rows = usage.usage_summary(**query)
        items = [
            {
                "keyId": r["key_id"],
                "keyPrefix": r["key_prefix"],
                "keyName": r["key_name"],
                "model": r["model"],
                "requests": r["requests"],
                "promptTokens": r["prompt_tokens"],
                "completionTokens": r["completion_tokens"],
                "totalTokens": r["prompt_tokens"] + r["completion_tokens"],
            }
            for r in rows
        ]
        totals = {
            name: sum(item[name] for item in items)
            for name in ("requests", "promptTokens", "completionTokens", "totalTokens")
        }
        return Response(
            {
                "from": query["start"].isoformat(),
                "to": query["end"].isoformat(),
                "usage": items,
                "totals": totals,
            }
        )


class _AnyAccept(DefaultContentNegotiation):
    """A CSV download is asked for with any Accept; errors still come back as JSON."""

    def select_renderer(
        self, request: Request, renderers: list[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        return renderers[0], renderers[0].media_type


class UsageCsv(APIView):
    content_negotiation_class = _AnyAccept

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
