"""API keys and usage in the Django admin: keys change through router.keys, usage is read-only.

A key's secret exists once, in router.keys.create_key's answer; the admin offers no
"add" (the console's Keys page and POST /api/keys create keys and show the secret
once). Hash, prefix and scopes are read-only, revoking is an action, and the fields
left (name, models, expiry, limits, queue fields, budgets) are checked and saved by router.keys, so the
admin refuses what PATCH /api/keys refuses (docs/decisions.md D60).
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.utils import timezone

from router import keys
from router.models import ApiKey, UsageDay, UsageMonth, UsageRecord


@admin.action(description="Revoke the selected keys")
def revoke(
    modeladmin: admin.ModelAdmin[ApiKey], request: HttpRequest, rows: QuerySet[ApiKey]
) -> None:
    for row in rows:
        keys.revoke_key(row.pk)  # save(): every router drops the key from its cache
    modeladmin.message_user(request, f"Revoked {len(rows)} key(s).", messages.SUCCESS)


class KeyStateFilter(admin.SimpleListFilter):
    """Active, expired or revoked: what /v1 makes of the key now (ApiKey.usable)."""

    title = "state"
    parameter_name = "state"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [("active", "Active"), ("expired", "Expired"), ("revoked", "Revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = timezone.now()
        if self.value() == "active":
            return queryset.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now)).filter(
                revoked_at__isnull=True
            )
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        return queryset


class ApiKeyForm(forms.ModelForm[ApiKey]):
    """The editable fields of a key, checked by router.keys.clean_changes."""

    class Meta:
        model = ApiKey
        fields = ("name", "model_allowlist", "expires_at", "rpm_limit", "tpm_limit",
                  "concurrency_limit", "priority", "queue_timeout_seconds",
                  "daily_token_budget", "monthly_token_budget", "budget_timezone")  # fmt: skip

    changes: dict[str, Any]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        wanted = {f: cleaned.get(f) for f in self.changed_data if f in keys.EDITABLE_FIELDS}
        try:
            self.changes = keys.clean_changes(self.instance, wanted)
        except keys.KeyError_ as exc:
            self.add_error(exc.field if exc.field in self.fields else None, exc.reason)
        return cleaned


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    """Keys by name and prefix; no add (the secret is shown once elsewhere), revoke as an action."""

    form = ApiKeyForm
    list_display = (
        "name",
        "prefix",
        "state",
        "scopes",
        "rpm_limit",
        "tpm_limit",
        "concurrency_limit",
        "priority",
        "daily_token_budget",
        "monthly_token_budget",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    )
    list_filter = (KeyStateFilter, "created_at")
    search_fields = ("name", "prefix")
    actions = [revoke]
    # Scopes cannot change on an existing key (router.keys.update_key); a revocation
    # is the revoke action, so it keeps its first time.
    readonly_fields = (
        "state",
        "key_hash",
        "prefix",
        "scopes",
        "revoked_at",
        "created_at",
        "last_used_at",
    )

    @admin.display(description="state")
    def state(self, row: ApiKey) -> str:
        if row.revoked_at is not None:
            return "Revoked"
        return "Active" if row.usable() else "Expired"

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        """Save what the form checked through router.keys (post_save tells every router)."""
        assert isinstance(form, ApiKeyForm) and change  # no add: has_add_permission
        saved = keys.update_key(obj.pk, form.changes)
        obj.refresh_from_db()
        assert obj.pk == saved.pk

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A key is created by router.keys.create_key, the only place its plaintext exists;
        # an admin form would either lose the secret or make a key without one (D60).
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        # DELETE /api/keys/{id} revokes and keeps the row, so its usage keeps its key.
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin[UsageRecord]):
    """Written by router.usage.UsageMeter only: listed, searched and filtered, never changed."""

    list_display = (
        "hour",
        "key_prefix",
        "key_name",
        "model",
        "requests",
        "prompt_tokens",
        "completion_tokens",
    )
    list_filter = ("model", "key")
    list_select_related = ("key",)
    search_fields = ("key_prefix", "key__name", "model")
    date_hierarchy = "hour"
    ordering = ("-hour", "-id")

    @admin.display(description="key", ordering="key__name")
    def key_name(self, row: UsageRecord) -> str:
        return row.key.name if row.key is not None else "(deleted)"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: UsageRecord | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: UsageRecord | None = None) -> bool:
        return False


class _RollupAdmin(admin.ModelAdmin[Any]):
    """Written by router.usage.UsageMeter only, like the hourly rows: read-only."""

    list_display: tuple[str, ...] = (
        "key_prefix", "model", "requests", "prompt_tokens", "completion_tokens",
    )  # fmt: skip
    list_filter = ("model",)
    search_fields = ("key_prefix", "key__name", "model")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(UsageDay)
class UsageDayAdmin(_RollupAdmin):
    """Usage per key, served name and UTC day."""

    list_display = ("day", *_RollupAdmin.list_display)
    date_hierarchy = "day"
    ordering = ("-day", "-id")


@admin.register(UsageMonth)
class UsageMonthAdmin(_RollupAdmin):
    """Usage per key, served name and UTC month."""

    list_display = ("month", *_RollupAdmin.list_display)
    ordering = ("-month", "-id")
