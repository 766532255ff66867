"""/api/nodes: the registry with each node's live state from the status cache."""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ServiceError
from nodes import services, status_cache
from nodes.models import Node
from nodes.states import registry_state


def node_state(node: Node, status: status_cache.NodeStatus | None) -> str:
    fixed = registry_state(approved=node.approved, revoked=node.revoked)
    if fixed is not None:
        return fixed.value
    return (status or {}).get("state", "Offline")


def node_json(node: Node, status: status_cache.NodeStatus | None) -> dict[str, Any]:
    status = status or {}
    telemetry = status.get("telemetry") or {}
    return {
        "nodeId": node.node_id,
        "displayName": node.display_name,
        "address": node.address,
        "approved": node.approved,
        "revoked": node.revoked,
        "draining": node.draining,
        "maintenance": _maintenance_json(node),
        "bootstrap": node.is_bootstrap,
        "enrolled": node.enrolled,
        "state": node_state(node, status),
        "fingerprint": f"SHA256:{node.spki_pin}" if node.spki_pin else None,
        "reasons": status.get("reasons", []),
        "lastSeen": status.get("lastSeen"),
        "lastError": status.get("lastError", ""),
        "fencing": status.get("fencing"),
        "bootId": status.get("bootId"),
        "agentVersion": node.agent_version,
        "os": node.os,
        "arch": node.arch,
        "memoryTotalBytes": node.memory_total_bytes,
        "memoryReserveBytes": node.memory_reserve_bytes,
        "gpuReserves": {
            g["uuid"]: node.gpu_reserve(g["uuid"])
            for g in (node.facts or {}).get("gpus") or []
            if isinstance(g, dict) and isinstance(g.get("uuid"), str)
        }
        | dict(node.gpu_reserves or {}),
        "facts": node.facts,
        "certificateNotAfter": node.cert_not_after.isoformat() if node.cert_not_after else None,
        "telemetry": telemetry,
        "instances": list((status.get("instances") or {}).values()),
        # Redis unreachable: the last status this process read ("last-known", as of
        # statusAsOf), or none at all ("unknown").
        "statusSource": status_cache.source(status),
        "stale": status_cache.source(status) != status_cache.LIVE,
        "statusAsOf": status.get("statusAsOf"),
    }


class NodeList(APIView):
    def get(self, request: Request) -> Response:
        nodes = list(Node.objects.all())
        statuses = status_cache.read_many([n.node_id for n in nodes])
        stale, as_of = status_cache.oldest_as_of(statuses)
        return Response(
            {
                "nodes": [node_json(n, statuses.get(n.node_id)) for n in nodes],
                "stale": stale,
                "statusAsOf": as_of,
            }
        )


class NodeDetail(APIView):
    def get(self, request: Request, node_id: str) -> Response:
        node = Node.objects.filter(node_id=node_id).first()
        if node is None:
            raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
        return Response(node_json(node, status_cache.read(node_id)))

    def patch(self, request: Request, node_id: str) -> Response:
        """Change what admission keeps free: memoryReserveBytes and gpuReserves."""
        body = request.data if isinstance(request.data, dict) else None
        if body is None:
            raise ServiceError(400, "invalid_request", "The body must be a JSON object.")
        node = services.set_reserves(
            node_id,
            memory_reserve=body.get("memoryReserveBytes"),
            gpu_reserves=body.get("gpuReserves"),
            unknown=sorted(set(body) - {"memoryReserveBytes", "gpuReserves"}),
        )
        return Response(node_json(node, status_cache.read(node_id)))


def _maintenance_json(node: Node) -> dict[str, Any] | None:
    left = node.maintenance_left()
    if not left or node.maintenance_until is None:
        return None
    return {
        "until": node.maintenance_until.isoformat().replace("+00:00", "Z"),
        "secondsLeft": int(left),
        "reason": node.maintenance_reason,
    }


class NodeMaintenance(APIView):
    """POST /api/nodes/{id}/maintenance {"seconds": N, "reason": "..."}; DELETE ends it."""

    def post(self, request: Request, node_id: str) -> Response:
        body = request.data if isinstance(request.data, dict) else None
        if body is None:
            raise ServiceError(400, "invalid_request", "The body must be a JSON object.")
        unknown = sorted(set(body) - {"seconds", "reason"})
        if unknown:
            raise ServiceError(
                400,
                "invalid_request",
                f"Unknown field(s): {', '.join(unknown)}; use seconds, reason.",
            )
        node = services.start_maintenance(
            node_id, seconds=body.get("seconds"), reason=body.get("reason", "")
        )
        services.announce(node)
        return Response(node_json(node, _status_of(node)))

    def delete(self, request: Request, node_id: str) -> Response:
        node = services.end_maintenance(node_id)
        services.announce(node)
        return Response(node_json(node, _status_of(node)))


def _status_of(node: Node) -> status_cache.NodeStatus | None:
    return status_cache.read(node.node_id)


class JoinTokenCreate(APIView):
    """POST /api/join-tokens: a single-use token, shown once, and the join command."""

    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        result = services.create_join_token(
            node_id=body.get("nodeId"), lifetime_minutes=body.get("lifetimeMinutes")
        )
        return Response(result, status=201)


class NodeAction(APIView):
    """POST /api/nodes/{id}/approve | revoke | drain | undrain."""

    action = ""

    def post(self, request: Request, node_id: str) -> Response:
        if self.action == "approve":
            node = services.approve_node(node_id)
        elif self.action == "revoke":
            node = services.revoke_node(node_id)
        else:
            node = services.set_draining(node_id, self.action == "drain")
        services.announce(node)
        return Response(node_json(node, _status_of(node)))


class Takeover(APIView):
    """POST /api/takeover: the operator's explicit fencing takeover."""

    def post(self, request: Request) -> Response:
        return Response(services.takeover())


class NodeRekey(APIView):
    """POST /api/nodes/{id}/rekey: a single-use token to re-enroll a node that lost its key."""

    def post(self, request: Request, node_id: str) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        result = services.rekey_node(node_id, lifetime_minutes=body.get("lifetimeMinutes"))
        return Response(result, status=201)


class ModelFolderGguf(APIView):
    """GET /api/model-folders/{folder}/gguf?file=&node=: a GGUF header summary from a node."""

    def get(self, request: Request, folder: str) -> Response:
        return Response(
            services.read_gguf(
                node_param=request.query_params.get("node"),
                folder=folder,
                file=request.query_params.get("file"),
            )
        )
