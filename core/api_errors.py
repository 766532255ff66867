"""DRF exception handler: every /api error is ``{"error": {"code", "message"}}``."""

from __future__ import annotations

import logging
from typing import Any

from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler

from core.errors import ServiceError
from protocol.atomic import AtomicWriteError

log = logging.getLogger("mirbad.api")

_CODES = {
    status.HTTP_400_BAD_REQUEST: "invalid_request",
    status.HTTP_401_UNAUTHORIZED: "unauthorized",
    status.HTTP_403_FORBIDDEN: "forbidden",
    status.HTTP_404_NOT_FOUND: "not_found",
    status.HTTP_405_METHOD_NOT_ALLOWED: "method_not_allowed",
    status.HTTP_415_UNSUPPORTED_MEDIA_TYPE: "unsupported_media_type",
    status.HTTP_429_TOO_MANY_REQUESTS: "rate_limited",
}


def _flatten(detail: Any, prefix: str = "") -> list[str]:
    if isinstance(detail, dict):
        out: list[str] = []
        for key, value in detail.items():
            name = key if not prefix else f"{prefix}.{key}"
            out += _flatten(value, "" if key == "non_field_errors" else name)
        return out
    if isinstance(detail, list):
        out = []
        for item in detail:
            out += _flatten(item, prefix)
        return out
    return [f"{prefix}: {detail}" if prefix else str(detail)]


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ServiceError):
        return Response(exc.as_json(), status=exc.status)
    if isinstance(exc, AtomicWriteError):
        # A state file could not be written (EIO, disk full): name it, never a bare 500.
        log.error("%s", exc)
        return Response({"error": {"code": "state_unavailable", "message": str(exc)}}, status=503)
    response = drf_handler(exc, context)
    if response is None:
        return None
    code = _CODES.get(response.status_code, "error")
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        response.status_code = status.HTTP_401_UNAUTHORIZED
        code = "unauthorized"
    body: dict[str, Any] = {"code": code, "message": "; ".join(_flatten(response.data))}
    if isinstance(exc, exceptions.ValidationError):
        body["fields"] = response.data
    response.data = {"error": body}
    return response
