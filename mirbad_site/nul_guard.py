"""A NUL in a query string or a posted form is a 400 before any view runs.

PostgreSQL refuses a NUL (``\\x00``) in every text value, so a search box, an admin
filter or a form field holding one would reach the database and fail there (a 500,
or a page that differs between SQLite and PostgreSQL). No field of ours takes one;
refusing it once, here, covers every page. JSON bodies are checked by
``core.jsoninput.is_text`` where they are parsed. Under /api the refusals are the
``{"error": {...}}`` JSON of every /api error (mirbad_site.api_pages).
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

from mirbad_site.api_pages import api_error, is_api

__all__ = ["RejectNulMiddleware"]

FORMS = ("application/x-www-form-urlencoded", "multipart/form-data")


def _first_nul(params: object) -> str | None:
    for key, values in params.lists():  # type: ignore[attr-defined]  # a QueryDict
        if "\x00" in key or any("\x00" in v for v in values):
            return key.replace("\x00", "\\x00")[:60]
    return None


def _too_big(request: HttpRequest) -> HttpResponse:
    """413 with the limit, not Django's bare "Bad Request": a form (or an uploaded
    backup) over DATA_UPLOAD_MAX_MEMORY_SIZE is refused before anything reads it."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    message = (
        f"The form is larger than {limit} bytes, the most the console accepts before "
        "logging in is checked. A larger backup file is restored on the master host "
        'with: python manage.py restore FILE (docs/operator-guide.md, "Restore").'
    )
    if is_api(request):
        return api_error(413, "too_large", message)
    return HttpResponse(message, status=413, content_type="text/plain; charset=utf-8")


class RejectNulMiddleware:
    """400 naming the parameter when a query or form parameter holds a NUL."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        where = "query string"
        bad = _first_nul(request.GET)
        if bad is None and request.method == "POST" and request.content_type in FORMS:
            # Read the body first: parsing a multipart form from the stream would leave
            # nothing for a view that reads request.body (the editor's JSON endpoint
            # answers a form post with a 400 of its own). The size limit still applies.
            try:
                request.body  # noqa: B018
            except RequestDataTooBig:
                return _too_big(request)
            where, bad = "form", _first_nul(request.POST)
        if bad is not None:
            message = (
                f"The {where} parameter '{bad}' holds a NUL character (\\x00); "
                "remove it and try again."
            )
            if is_api(request):
                return api_error(400, "invalid_request", message)
            return HttpResponseBadRequest(message, content_type="text/plain; charset=utf-8")
        return self.get_response(request)
