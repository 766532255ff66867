"""/api/schema (OpenAPI 3, from drf-spectacular) and /api/docs (Swagger UI over it).

Both are for the operators /api serves (``IsOperator``: a staff console login or a
key with the ``admin`` scope, docs/decisions.md D41), and refuse others with the
``{"error": {...}}`` JSON of every /api error, whatever the page would have been.

The docs page takes Swagger UI from drf-spectacular-sidecar (static files of this
server: nothing comes from a CDN) and its start-up script from ``?script``, so the
page runs under a CSP without inline script. It gets its own policy,
:data:`DOCS_CONTENT_SECURITY_POLICY`: the console's plus ``data:`` images, which
Swagger UI's stylesheet uses for its icons.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from mirbad_site.csp import CONTENT_SECURITY_POLICY

DOCS_CONTENT_SECURITY_POLICY = CONTENT_SECURITY_POLICY.replace(
    "img-src 'self'", "img-src 'self' data:"
)


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """``Authorization: Bearer <key>`` in the schema (mirbad_site.api_auth)."""

    target_class = "mirbad_site.api_auth.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key with the 'admin' scope.",
        }


class _JsonErrors(APIView):
    """Refusals as the ``{"error": {...}}`` JSON of /api, not as YAML or an HTML page."""

    def handle_exception(self, exc: Exception) -> Response:
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return super().handle_exception(exc)


class SchemaView(_JsonErrors, SpectacularAPIView):
    """GET /api/schema: YAML by default, JSON with ``?format=json`` or ``Accept``."""


class DocsView(_JsonErrors, SpectacularSwaggerSplitView):
    """GET /api/docs: Swagger UI; ``?script`` is its start-up script."""

    template_name = "api/swagger_ui.html"
    url_name = "api-schema"

    @extend_schema(exclude=True)
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        response: Response = super().get(request, *args, **kwargs)
        if request.GET.get("script") is None:
            response["Content-Security-Policy"] = DOCS_CONTENT_SECURITY_POLICY
        return response
