"""/api/keys: create (shown once), list, change, revoke."""

from __future__ import annotations

import datetime
from typing import Any

from django.utils.dateparse import parse_datetime
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ServiceError
from router import keys
from router.models import ApiKey

DEFAULT_SCOPES = ["chat", "completions", "embeddings", "rerank"]
# The API speaks camelCase; services use the model's field names.
_FIELDS = {
    "name": "name",
    "scopes": "scopes",
    "models": "model_allowlist",
    "expiresAt": "expires_at",
    "rpmLimit": "rpm_limit",
    "tpmLimit": "tpm_limit",
    "concurrencyLimit": "concurrency_limit",
}


def _refusal(exc: keys.KeyError_) -> ServiceError:
    """The service names its field; say it as the API spells it."""
    api_name = next((k for k, v in _FIELDS.items() if v == exc.field), exc.field)
    return ServiceError(400, "invalid_request", f"{api_name}: {exc.reason}")


def _iso(moment: datetime.datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def key_json(row: ApiKey) -> dict[str, Any]:
    return {
        "id": row.pk,
        "name": row.name,
        "prefix": row.prefix,
        "scopes": row.scopes,
        "models": row.model_allowlist,
        "expiresAt": _iso(row.expires_at),
        "revokedAt": _iso(row.revoked_at),
        "createdAt": row.created_at.isoformat(),
        "lastUsedAt": _iso(row.last_used_at),
        "rpmLimit": row.rpm_limit,
        "tpmLimit": row.tpm_limit,
        "concurrencyLimit": row.concurrency_limit,
    }


def _translate(request: Request) -> dict[str, Any]:
    """The body as service arguments; types the services cannot judge are checked here."""
    body = request.data
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_request", "The body must be a JSON object.")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise ServiceError(
            400,
            "invalid_request",
            f"{unknown[0]}: unknown field; known fields are {', '.join(sorted(_FIELDS))}",
        )
    out = {_FIELDS[k]: v for k, v in body.items()}
    scopes = out.get("scopes")
    if "scopes" in out and (
        not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes)
    ):
        raise ServiceError(400, "invalid_request", "scopes: must be a list of strings.")
    if out.get("expires_at") is not None:
        try:
            expires = parse_datetime(str(out["expires_at"]))
        except ValueError:  # well-formed but impossible, e.g. month 13
            expires = None
        if expires is None or expires.tzinfo is None:
            raise ServiceError(
                400, "invalid_request", "expiresAt: use an ISO 8601 time with a zone."
            )
        out["expires_at"] = expires
    return out


class KeyList(APIView):
    def get(self, request: Request) -> Response:
        return Response({"keys": [key_json(k) for k in ApiKey.objects.all()]})

    def post(self, request: Request) -> Response:
        fields = _translate(request)
        fields.setdefault("scopes", DEFAULT_SCOPES)
        fields.setdefault("name", None)
        try:
            row, key = keys.create_key(**fields)
        except keys.KeyError_ as exc:
            raise _refusal(exc) from None
        return Response({**key_json(row), "key": key}, status=status.HTTP_201_CREATED)


class KeyDetail(APIView):
    def patch(self, request: Request, key_id: int) -> Response:
        changes = _translate(request)
        try:
            row = keys.update_key(key_id, changes)
        except keys.KeyNotFound as exc:
            raise ServiceError(404, "not_found", str(exc)) from None
        except keys.KeyError_ as exc:
            raise _refusal(exc) from None
        return Response(key_json(row))

    def delete(self, request: Request, key_id: int) -> Response:
        try:
            keys.revoke_key(key_id)
        except keys.KeyNotFound as exc:
            raise ServiceError(404, "not_found", str(exc)) from None
        return Response(status=status.HTTP_204_NO_CONTENT)
