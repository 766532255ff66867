"""/api authentication: a console session, or an API key with the admin scope."""

from __future__ import annotations

from typing import Any

from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from router import keys


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header.startswith("Bearer "):
            return None
        info = keys.lookup(header[7:].strip())
        if info is None:
            raise exceptions.AuthenticationFailed("The API key is unknown, revoked or expired.")
        return (None, info)

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="mirbad"'


class IsOperator(permissions.BasePermission):
    """Staff users of the console, or keys carrying the ``admin`` scope."""

    message = "This needs a console login or an API key with the 'admin' scope."

    def has_permission(self, request: Request, view: Any) -> bool:
        if isinstance(request.auth, keys.KeyInfo):
            return "admin" in request.auth.scopes
        user = request.user
        return bool(user is not None and user.is_authenticated and user.is_staff)
