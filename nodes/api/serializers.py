"""/api/nodes on the wire: request bodies in, a node with its live state out."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema_field, extend_schema_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError

from core import paging
from core.api_serializers import (
    INT_OR_EMPTY,
    ApiSerializer,
    IsoDateTime,
    JsonInt,
    JsonIntMap,
    JsonStr,
    JsonStrMap,
    body_error,
)
from nodes import status_cache
from nodes.listing import NodeValues
from nodes.models import MasterOperation, Node


class NodeChangeSerializer(ApiSerializer):
    """PATCH /api/nodes/{id}: what admission keeps free, and the node's labels."""

    memoryReserveBytes = JsonInt(help_text="Host RAM admission keeps free, in bytes.")
    gpuReserves = JsonIntMap(help_text="Bytes kept free per GPU UUID the node reported.")
    labels = JsonStrMap(
        help_text="The node's labels, key to value, replacing the ones it has ({} removes "
        'them all): at most 32; docs/operator-guide.md, "Node labels".'
    )


class MaintenanceSerializer(ApiSerializer):
    """POST /api/nodes/{id}/maintenance."""

    seconds = JsonInt(help_text="The hold's length, 1 to 604800 (7 days).")
    reason = JsonStr(help_text="Why; at most 200 characters.")

    def unknown_fields(self, unknown: list[str]) -> ValidationError:
        return body_error(f"Unknown field(s): {', '.join(unknown)}; use seconds, reason.")


class JoinTokenRequestSerializer(ApiSerializer):
    """POST /api/join-tokens: a JSON object or no body; unknown fields are ignored."""

    ignore_unknown = True

    nodeId = JsonStr(help_text="Lower-case letters, digits and '-', at most 40 characters.")
    lifetimeMinutes = JsonInt(help_text="1 to 10080; the master's default when left out.")


class RekeyRequestSerializer(ApiSerializer):
    """POST /api/nodes/{id}/rekey: a JSON object or no body; unknown fields are ignored."""

    ignore_unknown = True

    lifetimeMinutes = JsonInt(help_text="1 to 10080; the master's default when left out.")


class TokenSerializer(serializers.Serializer):
    """A join or rekey token: shown once, with the command to run on the node."""

    nodeId = serializers.CharField()
    token = serializers.CharField()
    expiresAt = serializers.CharField()
    caHash = serializers.CharField()
    enrollUrl = serializers.CharField()
    command = serializers.CharField()


class MaintenanceHoldSerializer(serializers.Serializer):
    until = serializers.CharField()
    secondsLeft = serializers.IntegerField()
    reason = serializers.CharField()


class RotationSerializer(serializers.Serializer):
    """A certificate rotation (nodes/rotation.py)."""

    rotationId = serializers.CharField(source="rotation_id")
    stage = serializers.CharField()
    open = serializers.BooleanField()
    reason = serializers.CharField()
    attempts = serializers.IntegerField()
    lastError = serializers.CharField(source="last_error")
    createdAt = IsoDateTime(source="created_at")
    finishedAt = IsoDateTime(source="finished_at", allow_null=True)


class NodeReasonSerializer(serializers.Serializer):
    """Why a node is not simply Online (an agent's reason, clock skew, a certificate)."""

    code = serializers.CharField()
    message = serializers.CharField()


def _status(serializer: serializers.Serializer, node: Node) -> status_cache.NodeStatus:
    """The node's effective status, from the ``statuses`` the view read (empty if none)."""
    statuses: dict[str, status_cache.NodeStatus | None] = serializer.context.get("statuses") or {}
    return statuses.get(node.node_id) or {}


def _maintenance(node: Node | NodeValues) -> dict[str, Any] | None:
    left = node.maintenance_left()
    if not left or node.maintenance_until is None:
        return None
    return {
        "until": node.maintenance_until.isoformat().replace("+00:00", "Z"),
        "secondsLeft": int(left),
        "reason": node.maintenance_reason,
    }


def _rotation(node: Node | NodeValues) -> dict[str, Any] | None:
    """The open rotation of the node's certificate, if one is under way."""
    prefetched = getattr(node, "open_rotations", None)  # the list prefetches them
    if prefetched is None and isinstance(node, Node):  # NodeValues always carry them
        open_rotation = node.rotations.filter(open=True).first()
    else:
        open_rotation = prefetched[0] if prefetched else None
    return RotationSerializer(open_rotation).data if open_rotation is not None else None


def _gpu_reserves(node: Node | NodeValues) -> dict[str, Any]:
    reported = {
        g["uuid"]: node.gpu_reserve(g["uuid"])
        for g in (node.facts or {}).get("gpus") or []
        if isinstance(g, dict) and isinstance(g.get("uuid"), str)
    }
    return reported | dict(node.gpu_reserves or {})


def _iso(value: Any) -> str | None:
    return None if value is None else str(value.isoformat())


def node_representation(node: Node | NodeValues, status: status_cache.NodeStatus) -> dict[str, Any]:
    """One node as ``NodeSerializer`` declares it, built directly.

    DRF's generic path (a field object, ``get_attribute`` and ``to_representation`` per
    field, per node) cost about a third of ``GET /api/nodes`` at 1,000 nodes (issue 19);
    this writes the same keys in the same order with the same values, which
    tests/nodes/test_node_representation.py checks against DRF's own rendering of the
    declared fields. The list passes its rows as ``nodes.listing.NodeValues`` (no Node
    instance built), which answer the same (the same test).
    """
    source = status_cache.source(status)
    return {
        "nodeId": str(node.node_id),
        "displayName": str(node.display_name),
        "address": str(node.address),
        "approved": bool(node.approved),
        "revoked": bool(node.revoked),
        "draining": bool(node.draining),
        "maintenance": _maintenance(node),
        "bootstrap": bool(node.is_bootstrap),
        "enrolled": bool(node.enrolled),
        "state": status.get("state", "Offline"),
        "fingerprint": f"SHA256:{node.spki_pin}" if node.spki_pin else None,
        "reasons": status.get("reasons", []),
        "lastSeen": status.get("lastSeen"),
        "lastError": status.get("lastError", ""),
        "fencing": status.get("fencing"),
        "bootId": status.get("bootId"),
        "agentVersion": str(node.agent_version),
        "os": str(node.os),
        "arch": str(node.arch),
        "memoryTotalBytes": (
            None if node.memory_total_bytes is None else int(node.memory_total_bytes)
        ),
        "memoryReserveBytes": int(node.memory_reserve_bytes),
        "gpuReserves": _gpu_reserves(node),
        "labels": dict(node.labels or {}),
        "facts": node.facts,
        "certificateNotAfter": _iso(node.cert_not_after),
        "rotation": _rotation(node),
        "telemetry": status.get("telemetry") or {},
        "instances": list((status.get("instances") or {}).values()),
        "statusSource": source,
        "stale": source != status_cache.LIVE,
        "statusAsOf": status.get("statusAsOf"),
    }


class NodeSerializer(serializers.Serializer):
    """A node: its registry fields and the live state from the status cache.

    The view passes ``context={"statuses": {node_id: status}}``, each from
    ``nodes.status`` (the effective status: registry, record, the 15 s rule). The
    declared fields are the schema; :func:`node_representation` writes them.
    """

    nodeId = serializers.CharField(source="node_id")
    displayName = serializers.CharField(source="display_name")
    address = serializers.CharField()
    approved = serializers.BooleanField()
    revoked = serializers.BooleanField()
    draining = serializers.BooleanField()
    maintenance = serializers.SerializerMethodField()
    bootstrap = serializers.BooleanField(source="is_bootstrap")
    enrolled = serializers.BooleanField()
    state = serializers.SerializerMethodField()
    fingerprint = serializers.SerializerMethodField()
    reasons = serializers.SerializerMethodField()
    lastSeen = serializers.SerializerMethodField()
    lastError = serializers.SerializerMethodField()
    fencing = serializers.SerializerMethodField()
    bootId = serializers.SerializerMethodField()
    agentVersion = serializers.CharField(source="agent_version")
    os = serializers.CharField()
    arch = serializers.CharField()
    memoryTotalBytes = serializers.IntegerField(source="memory_total_bytes", allow_null=True)
    memoryReserveBytes = serializers.IntegerField(source="memory_reserve_bytes")
    gpuReserves = serializers.SerializerMethodField()
    labels = serializers.DictField(child=serializers.CharField(allow_blank=True))
    facts = serializers.JSONField()
    certificateNotAfter = IsoDateTime(source="cert_not_after", allow_null=True)
    rotation = serializers.SerializerMethodField()
    telemetry = serializers.SerializerMethodField()
    instances = serializers.SerializerMethodField()
    # Redis unreachable: the last status this process read ("last-known", as of
    # statusAsOf), or none at all ("unknown").
    statusSource = serializers.SerializerMethodField()
    stale = serializers.SerializerMethodField()
    statusAsOf = serializers.SerializerMethodField()

    def to_representation(self, instance: Node) -> dict[str, Any]:
        return node_representation(instance, _status(self, instance))

    @extend_schema_field(MaintenanceHoldSerializer(allow_null=True))
    def get_maintenance(self, node: Node) -> dict[str, Any] | None:
        return _maintenance(node)

    @extend_schema_field(RotationSerializer(allow_null=True))
    def get_rotation(self, node: Node) -> dict[str, Any] | None:
        return _rotation(node)

    @extend_schema_field(OpenApiTypes.STR)
    def get_state(self, node: Node) -> Any:
        return _status(self, node).get("state", "Offline")

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_fingerprint(self, node: Node) -> str | None:
        return f"SHA256:{node.spki_pin}" if node.spki_pin else None

    @extend_schema_field(NodeReasonSerializer(many=True))
    def get_reasons(self, node: Node) -> Any:
        return _status(self, node).get("reasons", [])

    @extend_schema_field(
        serializers.FloatField(allow_null=True, help_text="Unix time of the last status.")
    )
    def get_lastSeen(self, node: Node) -> Any:
        return _status(self, node).get("lastSeen")

    @extend_schema_field(OpenApiTypes.STR)
    def get_lastError(self, node: Node) -> Any:
        return _status(self, node).get("lastError", "")

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_fencing(self, node: Node) -> Any:
        return _status(self, node).get("fencing")

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_bootId(self, node: Node) -> Any:
        return _status(self, node).get("bootId")

    @extend_schema_field({"type": "object", "additionalProperties": {"type": "integer"}})
    def get_gpuReserves(self, node: Node) -> dict[str, Any]:
        return _gpu_reserves(node)

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_telemetry(self, node: Node) -> Any:
        return _status(self, node).get("telemetry") or {}

    @extend_schema_field({"type": "array", "items": {"type": "object"}})
    def get_instances(self, node: Node) -> list[Any]:
        return list((_status(self, node).get("instances") or {}).values())

    @extend_schema_field({"type": "string", "enum": ["live", "last-known", "unknown"]})
    def get_statusSource(self, node: Node) -> str:
        return status_cache.source(_status(self, node))

    def get_stale(self, node: Node) -> bool:
        return self.get_statusSource(node) != status_cache.LIVE

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_statusAsOf(self, node: Node) -> Any:
        return _status(self, node).get("statusAsOf")


# The page of a fleet list (GET /api/nodes, GET /api/models; core.paging).
PAGE_PARAMETERS = [
    OpenApiParameter(
        "limit",
        INT_OR_EMPTY,
        description=f"At most this many, 1 to {paging.LIMIT_MAX}; left out: every matching "
        f"row up to {paging.UNPAGED_MAX}.",
    ),
    OpenApiParameter(
        "offset", INT_OR_EMPTY, description="Skip this many matching rows first (0 by default)."
    ),
]


class PageFieldsSerializer(serializers.Serializer):
    """What a fleet list says of its page: how many match, where it starts, the next."""

    count = serializers.IntegerField(help_text="How many rows match the filters.")
    offset = serializers.IntegerField()
    limit = serializers.IntegerField(help_text=f"The page's size ({paging.UNPAGED_MAX} unasked).")
    next = serializers.IntegerField(
        allow_null=True, help_text="The offset of the next page; null on the last."
    )


# many=False: the list actions answer one object that holds the list, not a bare array.
@extend_schema_serializer(many=False)
class NodeListSerializer(PageFieldsSerializer):
    nodes = NodeSerializer(many=True)
    stale = serializers.BooleanField()
    statusAsOf = serializers.FloatField(allow_null=True)


class TakeoverSerializer(serializers.Serializer):
    """What the explicit fencing takeover did (nodes.takeover.takeover)."""

    at = serializers.CharField()
    previousEpoch = serializers.IntegerField(allow_null=True)
    epoch = serializers.IntegerField()
    nodes = serializers.DictField(help_text="Per node: the epoch it had, or why unreachable.")


class MasterOperationSerializer(serializers.Serializer):
    """One mutation the master sent to the node (nodes/operations.py): open until its
    answer, or the agent's record (``reconciled``), closes it."""

    operationId = serializers.CharField(source="operation_id")
    kind = serializers.ChoiceField(choices=MasterOperation.Kind.choices)
    method = serializers.CharField()
    path = serializers.CharField()
    target = serializers.CharField(help_text="The instance id, folder or rotation id.")
    state = serializers.ChoiceField(choices=MasterOperation.State.choices)
    reconciled = serializers.BooleanField(
        help_text="Closed from the agent's record when the monitor reached the node."
    )
    statusCode = serializers.IntegerField(source="status_code", allow_null=True)
    summary = serializers.CharField(help_text="The answer or error, short and redacted.")
    attempts = serializers.IntegerField()
    openedAt = IsoDateTime(source="opened_at")
    closedAt = IsoDateTime(source="closed_at", allow_null=True)


class MasterOperationListSerializer(serializers.Serializer):
    operations = MasterOperationSerializer(many=True)
    more = serializers.BooleanField(help_text="More operations than the page holds.")


class NodeImageSerializer(serializers.Serializer):
    """One container image the node's Docker engine holds (docs/agent-api.md,
    "GET /agent/v1/images")."""

    id = serializers.CharField(help_text="The image id, sha256:<64 hex>.")
    tags = serializers.ListField(child=serializers.CharField(), help_text="repo:tag, sorted.")
    digests = serializers.ListField(
        child=serializers.CharField(), help_text="repo@sha256:..., sorted."
    )
    sizeBytes = serializers.IntegerField()
    createdAt = serializers.CharField(allow_null=True, help_text="ISO 8601, UTC.")


class NodeImageListSerializer(serializers.Serializer):
    node = serializers.CharField(help_text="The node's id.")
    images = NodeImageSerializer(
        many=True, help_text="Sorted by first tag (untagged last), then id."
    )
    truncated = serializers.BooleanField(help_text="The engine holds more than the 1000 listed.")
