"""API keys for /v1 and /api."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

SCOPES = ("chat", "completions", "embeddings", "rerank", "admin")


class ApiKey(models.Model):
    """A client key, stored as its SHA-256; the key itself is shown once at creation."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="The first characters, to recognise a key")
    key_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    model_allowlist = models.JSONField(default=list, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}...)"

    def usable(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()
