from django.contrib import admin

from router.models import ApiKey, UsageRecord


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
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
    readonly_fields = ("key_hash", "prefix")


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = ("hour", "key_prefix", "model", "requests", "prompt_tokens", "completion_tokens")
    list_filter = ("model",)
    readonly_fields = ("key", "key_prefix", "model", "hour")
