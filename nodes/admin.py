from django.contrib import admin

from nodes.models import JoinToken, Node


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("node_id", "address", "approved", "revoked", "draining", "enrolled_at")
    readonly_fields = ("spki_pin", "pending_pin", "cert_serial", "cert_not_after", "enrolled_at")


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    list_display = ("node_id", "purpose", "created_at", "expires_at", "used_at")
    readonly_fields = ("token_hash",)
