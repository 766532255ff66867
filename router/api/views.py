"""/api/keys: create (shown once), list, revoke."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from mirbad_site.errors import ServiceError
from router import keys
from router.models import ApiKey


def key_json(row: ApiKey) -> dict[str, Any]:
    return {
        "id": row.pk,
        "name": row.name,
        "prefix": row.prefix,
        "scopes": row.scopes,
        "models": row.model_allowlist,
        "expiresAt": row.expires_at.isoformat() if row.expires_at else None,
        "revokedAt": row.revoked_at.isoformat() if row.revoked_at else None,
        "createdAt": row.created_at.isoformat(),
    }


class KeyList(APIView):
    def get(self, request: Request) -> Response:
        return Response({"keys": [key_json(k) for k in ApiKey.objects.all()]})

    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        name = body.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= 100:
            raise ServiceError(400, "invalid_request", "name: give a name of 1-100 characters.")
        scopes = body.get("scopes", ["chat", "completions", "embeddings", "rerank"])
        models = body.get("models", [])
        if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
            raise ServiceError(400, "invalid_request", "scopes: must be a list of strings.")
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ServiceError(400, "invalid_request", "models: must be a list of served names.")
        expires = None
        if body.get("expiresAt") is not None:
            expires = parse_datetime(str(body["expiresAt"]))
            if expires is None or expires.tzinfo is None:
                raise ServiceError(
                    400, "invalid_request", "expiresAt: use an ISO 8601 time with a zone."
                )
        try:
            row, key = keys.create_key(
                name=name, scopes=scopes, model_allowlist=models, expires_at=expires
            )
        except keys.KeyError_ as exc:
            raise ServiceError(400, "invalid_request", str(exc)) from None
        return Response({**key_json(row), "key": key}, status=status.HTTP_201_CREATED)


class KeyDetail(APIView):
    def delete(self, request: Request, key_id: int) -> Response:
        updated = ApiKey.objects.filter(pk=key_id, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        if not updated and not ApiKey.objects.filter(pk=key_id).exists():
            raise ServiceError(404, "not_found", f"Key {key_id} does not exist.")
        return Response(status=status.HTTP_204_NO_CONTENT)
