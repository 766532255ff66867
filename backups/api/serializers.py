"""/api/backups on the wire."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from backups.models import BackupRun
from core.api_serializers import ApiSerializer, JsonBool, JsonStr


class BackupRequestSerializer(ApiSerializer):
    """POST /api/backups: a passphrase seals the secrets; without one there are none."""

    passphrase = JsonStr(help_text="At least 12 characters; omit for a backup without secrets.")
    includeCa = JsonBool(
        source="include_ca", help_text="Seal the CA certificate and key too (default true)."
    )


class BackupRunSerializer(serializers.Serializer[BackupRun]):
    """One backup run as the console lists it."""

    id = serializers.IntegerField(source="pk")
    kind = serializers.CharField()
    actor = serializers.CharField()
    startedAt = serializers.DateTimeField(source="started_at")
    finishedAt = serializers.DateTimeField(source="finished_at", allow_null=True)
    fileName = serializers.CharField(source="file_name")
    sizeBytes = serializers.IntegerField(source="size_bytes", allow_null=True)
    hasSecrets = serializers.BooleanField(source="has_secrets")
    hasCa = serializers.BooleanField(source="has_ca")
    models = serializers.IntegerField(source="models_count")
    nodes = serializers.IntegerField(source="nodes_count")
    pruned = serializers.IntegerField()
    error = serializers.CharField()


class BackupRunListSerializer(serializers.Serializer[Any]):
    runs = BackupRunSerializer(many=True)


class OnDemandSerializer(serializers.Serializer[Any]):
    """The answer to POST /api/backups: the run and its one-time link."""

    run = BackupRunSerializer()
    downloadUrl = serializers.CharField(help_text="GET it once, within 10 minutes.")
    expiresAt = serializers.DateTimeField()
