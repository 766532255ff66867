"""API keys in the Django admin: hashes and scopes are router.keys', revoking is an action."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from router import keys
from router.models import ApiKey, UsageRecord


@admin.action(description="Revoke the selected keys")
def revoke(
    modeladmin: admin.ModelAdmin[ApiKey], request: HttpRequest, rows: QuerySet[ApiKey]
) -> None:
    for row in rows:
        keys.revoke_key(row.pk)  # save(): every router drops the key from its cache
    modeladmin.message_user(request, f"Revoked {len(rows)} key(s).", messages.SUCCESS)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = (
        "name",
        "prefix",
        "scopes",
        "rpm_limit",
        "tpm_limit",
        "concurrency_limit",
        "created_at",
        "expires_at",
        "revoked_at",
    )
    actions = [revoke]
    # Scopes cannot change on an existing key (router.keys.update_key); a revocation
    # is the revoke action, so it keeps its first time.
    readonly_fields = ("key_hash", "prefix", "scopes", "revoked_at", "created_at", "last_used_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A key is created by router.keys.create_key, the only place its plaintext exists.
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin[UsageRecord]):
    list_display = ("hour", "key_prefix", "model", "requests", "prompt_tokens", "completion_tokens")
    list_filter = ("model",)
    readonly_fields = ("key", "key_prefix", "model", "hour")
