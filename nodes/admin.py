"""Nodes in the Django admin: the trust fields are the services', the commands are actions.

Approval, revocation, draining, pins, the certificate and what the agent reports
change only through nodes.services (pins dropped and tokens deleted on revoke, the
monitor told, which updates the status cache and the console), so the change form
shows them read-only and the list offers the same commands as /api. The state
column is the live one, read through nodes.status like every other reader
(docs/decisions.md D41, D60).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from urllib.parse import urlsplit

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import formats, timezone

from core.errors import ServiceError
from nodes import events, services, status
from nodes.models import AuditEvent, CertRotation, JoinToken, MasterOperation, Node
from nodes.status_cache import NodeStatus

# Where a changelist row keeps the status read for the whole page.
_STATUS = "_admin_status"


def _status_of(node: Node) -> NodeStatus:
    """The status read for the page, or one read now (the change form)."""
    cached = getattr(node, _STATUS, None)
    if cached is None:
        cached = status.read(node)
        setattr(node, _STATUS, cached)
    return cached


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


class NodeForm(forms.ModelForm):
    """What is left to edit on a node: its display name and the address the master dials."""

    # A bare host:port is read as https://, the only scheme the master dials.
    address = forms.URLField(
        assume_scheme="https", help_text="The agent URL the master dials, https://host:port"
    )

    class Meta:
        model = Node
        fields = ("display_name", "address")

    def clean_address(self) -> str:
        address = self.cleaned_data["address"]
        # The master dials agents over mutual TLS only (docs/decisions.md D4); the
        # URL field alone would also take http:// and ftp://.
        parts = urlsplit(address)
        if parts.scheme != "https" or not parts.hostname or parts.path not in ("", "/"):
            raise forms.ValidationError("Give the agent's URL as https://host:port, no path.")
        return address


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Nodes with their live state; approval, revocation and draining are actions."""

    form = NodeForm
    list_display = (
        "node_id",
        "display_name",
        "state",
        "approved",
        "draining",
        "revoked",
        "address",
        "agent_version",
        "last_seen",
        "cert_not_after",
    )
    list_filter = ("approved", "draining", "revoked", "is_bootstrap", "os", "arch")
    search_fields = ("node_id", "display_name", "address", "facts__hostname")
    actions = [approve, revoke, drain, undrain, end_maintenance]
    readonly_fields = (
        "node_id",
        "state",
        "last_seen",
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
        "cert_renewal_error",
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

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        """The page's rows with their effective statuses, read in one Redis round trip."""
        changelist = super().get_changelist_instance(request)
        rows = list(changelist.result_list)  # evaluated once; the template reuses the rows
        statuses = status.read_many(rows)
        for node in rows:
            setattr(node, _STATUS, statuses[node.node_id])
        return changelist

    @admin.display(description="state")
    def state(self, node: Node) -> str:
        """The live state (nodes.status: registry first, then the monitor's record)."""
        return status.state_of(_status_of(node))

    @admin.display(description="last seen")
    def last_seen(self, node: Node) -> str:
        seen = _status_of(node).get("lastSeen")
        if not isinstance(seen, int | float):
            return "-"
        moment = dt.datetime.fromtimestamp(seen, tz=dt.UTC)
        return formats.date_format(timezone.localtime(moment), "DATETIME_FORMAT")

    def save_model(
        self, request: HttpRequest, obj: Node, form: forms.ModelForm, change: bool
    ) -> None:
        super().save_model(request, obj, form, change)
        if "address" in form.changed_data:
            # The monitor dials the new address at once instead of at its next refresh.
            events.tell_monitor(obj.node_id)

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A node exists once it enrolls with a join token (POST /api/join-tokens).
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        # No service deletes a node (its placements, pins and audit trail refer to it):
        # a node that must go is revoked (docs/decisions.md D60).
        return False


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    """Tokens are issued by the services (shown once); here they can be seen or deleted."""

    list_display = ("node_id", "purpose", "created_at", "expires_at", "used_at")
    list_filter = ("purpose",)
    search_fields = ("node_id",)
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
    search_fields = ("rotation_id", "node__node_id")
    list_select_related = ("node",)


@admin.register(AuditEvent)
class AuditEventAdmin(_ReadOnly):
    list_display = ("at", "actor", "source", "action", "node_id", "subject")
    list_filter = ("action", "actor")
    search_fields = ("node_id", "subject", "actor", "action", "source")
    date_hierarchy = "at"


@admin.register(MasterOperation)
class MasterOperationAdmin(_ReadOnly):
    list_display = ("opened_at", "node", "kind", "target", "state", "reconciled", "attempts")
    list_filter = ("state", "kind", "reconciled")
    search_fields = ("operation_id", "node__node_id", "target")
    list_select_related = ("node",)
