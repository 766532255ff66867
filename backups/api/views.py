"""/api/backups: list runs, make one now, fetch it once (thin; backups.services decides)."""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from backups import services
from backups.api.serializers import (
    BackupRequestSerializer,
    BackupRunListSerializer,
    BackupRunSerializer,
    OnDemandSerializer,
)
from core.api_serializers import errors, parse
from core.errors import ServiceError
from nodes import audit


def actor_of(request: Request) -> str:
    """Who asked, as the audit log names them (one rule: nodes.audit)."""
    return audit.current_origin().actor


def download_path(token: str) -> str:
    return f"/api/backups/download/{token}"


@extend_schema(tags=["backups"])
class BackupsView(APIView):
    @extend_schema(responses={200: BackupRunListSerializer})
    def get(self, request: Request) -> Response:
        runs = services.recent_runs()
        return Response({"runs": [BackupRunSerializer(run).data for run in runs]})

    @extend_schema(
        request=BackupRequestSerializer, responses={201: OnDemandSerializer, **errors(400)}
    )
    def post(self, request: Request) -> Response:
        fields = parse(BackupRequestSerializer, request.data)
        passphrase = services.check_passphrase(fields.get("passphrase"))
        include_ca = fields.get("include_ca", True)
        if not isinstance(include_ca, bool):
            raise ServiceError(400, "invalid_request", "includeCa must be true or false")
        made = services.create_on_demand(
            actor=actor_of(request), passphrase=passphrase, include_ca=include_ca
        )
        body = {
            "run": made.run,
            "downloadUrl": download_path(made.token),
            "expiresAt": made.expires_at,
        }
        return Response(OnDemandSerializer(body).data, status=status.HTTP_201_CREATED)


@extend_schema(tags=["backups"])
class BackupDownloadView(APIView):
    @extend_schema(
        responses={
            200: OpenApiResponse(description="The backup document (JSON)"),
            **errors(404, 410),
        }
    )
    def get(self, request: Request, token: str) -> HttpResponse:
        name, content = services.take_download(token)
        response = HttpResponse(content, content_type="application/json")
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        response["Cache-Control"] = "no-store"
        return response
