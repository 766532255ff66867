"""/api/nodes: the registry with each node's live state from the status cache."""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from mirbad_site.errors import ServiceError
from nodes import status_cache
from nodes.models import Node


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
        "bootstrap": node.is_bootstrap,
        "enrolled": node.enrolled,
        "state": status.get("state", "Offline"),
        "reasons": status.get("reasons", []),
        "lastSeen": status.get("lastSeen"),
        "lastError": status.get("lastError", ""),
        "agentVersion": node.agent_version,
        "os": node.os,
        "arch": node.arch,
        "certificateNotAfter": node.cert_not_after.isoformat() if node.cert_not_after else None,
        "telemetry": telemetry,
        "instances": list((status.get("instances") or {}).values()),
    }


class NodeList(APIView):
    def get(self, request: Request) -> Response:
        nodes = list(Node.objects.all())
        statuses = status_cache.read_many([n.node_id for n in nodes])
        return Response({"nodes": [node_json(n, statuses.get(n.node_id)) for n in nodes]})


class NodeDetail(APIView):
    def get(self, request: Request, node_id: str) -> Response:
        node = Node.objects.filter(node_id=node_id).first()
        if node is None:
            raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
        return Response(node_json(node, status_cache.read(node_id)))
