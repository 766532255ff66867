"""Nodes in the Django admin: the trust fields are the services', the commands are actions.

Approval, revocation, pins, the certificate and what the agent reports change only
through nodes.services (pins dropped and tokens deleted on revoke, the monitor told,
which updates the status cache and the console), so the change form shows them read-only and the list offers
the same commands as /api (docs/decisions.md D41).
"""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from core.errors import ServiceError
from nodes import services
from nodes.models import AuditEvent, CertRotation, JoinToken, Node


def _each(
    modeladmin: admin.ModelAdmin, request: HttpRequest, nodes: QuerySet[Node], verb: str,
    command: Callable[[str], Node],
) -> None:  # fmt: skip
    """Run a service command per node; a refusal is reported, the others still run."""
    done = []
    for node in nodes:
        try:
            command(node.node_id)
        except ServiceError as exc:
            modeladmin.message_user(request, f"{node.node_id}: {exc.message}", messages.ERROR)
        else:
            done.append(node.node_id)
    if done:
        modeladmin.message_user(request, f"{verb}: {', '.join(done)}", messages.SUCCESS)


@admin.action(description="Approve the selected nodes")
def approve(modeladmin: admin.ModelAdmin, request: HttpRequest, nodes: QuerySet[Node]) -> None:
    _each(modeladmin, request, nodes, "Approved", services.approve_node)


@admin.action(description="Revoke the selected nodes (drops their pins and tokens)")
def revoke(modeladmin: admin.ModelAdmin, request: HttpRequest, nodes: QuerySet[Node]) -> None:
    _each(modeladmin, request, nodes, "Revoked", services.revoke_node)


@admin.action(description="Drain the selected nodes")
def drain(modeladmin: admin.ModelAdmin, request: HttpRequest, nodes: QuerySet[Node]) -> None:
    _each(modeladmin, request, nodes, "Draining", lambda n: services.set_draining(n, True))


@admin.action(description="Undrain the selected nodes")
def undrain(modeladmin: admin.ModelAdmin, request: HttpRequest, nodes: QuerySet[Node]) -> None:
    _each(modeladmin, request, nodes, "Undrained", lambda n: services.set_draining(n, False))


@admin.action(description="End the maintenance hold of the selected nodes")
def end_maintenance(
    modeladmin: admin.ModelAdmin, request: HttpRequest, nodes: QuerySet[Node]
) -> None:
    _each(modeladmin, request, nodes, "Maintenance ended", services.end_maintenance)


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("node_id", "address", "approved", "revoked", "draining", "enrolled_at")
    actions = [approve, revoke, drain, undrain, end_maintenance]
    # What is left to edit here: the display name and the address the master dials.
    readonly_fields = (
        "node_id",
        "is_bootstrap",
        "approved",
        "revoked",
        "draining",
        "maintenance_until",
        "maintenance_reason",
        "spki_pin",
        "pending_pin",
        "cert_serial",
        "cert_not_after",
        "enrolled_at",
        "agent_version",
        "protocol_version",
        "os",
        "arch",
        "memory_total_bytes",
        "facts",
        "memory_reserve_bytes",
        "gpu_reserves",
        "created_at",
        "updated_at",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A node exists once it enrolls with a join token (POST /api/join-tokens).
        return False


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    """Tokens are issued by the services (shown once); here they can be seen or deleted."""

    list_display = ("node_id", "purpose", "created_at", "expires_at", "used_at")
    readonly_fields = ("token_hash", "node_id", "purpose", "created_at", "expires_at", "used_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


class _ReadOnly(admin.ModelAdmin):
    """Records written by the services only: listed here, never changed by hand."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(CertRotation)
class CertRotationAdmin(_ReadOnly):
    list_display = ("rotation_id", "node", "stage", "open", "reason", "attempts", "created_at")
    list_filter = ("stage", "open", "reason")


@admin.register(AuditEvent)
class AuditEventAdmin(_ReadOnly):
    list_display = ("at", "actor", "action", "node_id", "subject")
    list_filter = ("action",)
    search_fields = ("node_id", "subject", "actor")
