from django.contrib import admin

from router.models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "scopes", "created_at", "expires_at", "revoked_at")
    readonly_fields = ("key_hash", "prefix")
