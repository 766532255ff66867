"""/api authentication: a console session, or an API key with the admin scope.

Failed key lookups count towards the source address's limit, shared with /v1
(core.throttle): past it, a key is not looked up and the answer is 429.
"""

from __future__ import annotations

from typing import Any

from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from core import throttle
from router import keys

_BLOCKED = "Too many failed API key lookups from this address; no key is checked for now."


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header.startswith("Bearer "):
            return None
        address = request.META.get("REMOTE_ADDR")
        wait = throttle.key_failures.blocked(address)
        if wait is not None:
            raise exceptions.Throttled(wait=wait, detail=_BLOCKED)
        token = header[7:].strip()
        info = keys.lookup(token)
        if info is None:
            verdict = throttle.key_failures.record(
                address, where=request.path, prefix=throttle.key_prefix(token)
            )
            if verdict.refused:
                raise exceptions.Throttled(wait=verdict.retry_after, detail=_BLOCKED)
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
