"""/api answers made outside DRF, in the ``{"error": {...}}`` JSON of every /api error.

DRF's exception handler (core.api_errors) shapes what a view refuses. A request can
be answered before any view: a path no route matches (``/api/models/abc`` misses
the ``<int:model_id>`` converter), a middleware refusal (a NUL in the query,
mirbad_site.nul_guard), an exception no handler caught. Under /api those answers
keep the same shape, from the same rule (``ServiceError.as_json``), so a client
parses one kind of error; elsewhere Django's pages stay as they were.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults

from core.errors import ServiceError


def is_api(request: HttpRequest) -> bool:
    return request.path == "/api" or request.path.startswith("/api/")


def api_error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(ServiceError(status, code, message).as_json(), status=status)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """``handler404``: no route matched (or a view raised Http404)."""
    if is_api(request):
        return api_error(
            404,
            "not_found",
            f"No /api route matches {request.path[:200]!r}: check the path and that its "
            "ids are spelled as /api/docs says (a model or key id is a whole number).",
        )
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """``handler500``: an exception nothing caught (a bug; the log has its traceback)."""
    if is_api(request):
        return api_error(
            500, "internal_error", "The master failed to answer; its log names the cause."
        )
    return defaults.server_error(request)
