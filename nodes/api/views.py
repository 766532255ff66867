"""/api/nodes: the registry with each node's live state from the status cache.

Thin: serializers check the bodies and shape the answers, nodes.services decides.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from core import paging
from core.api_serializers import INT_OR_EMPTY, errors, parse
from core.errors import ServiceError
from nodes import audit, listing, rotation, services, status_cache, takeover
from nodes import labels as node_labels
from nodes import operations as master_operations
from nodes import status as node_status
from nodes.agent_client import AgentClient, AgentRefused, AgentTimeout, AgentUnreachable
from nodes.api.serializers import (
    PAGE_PARAMETERS,
    JoinTokenRequestSerializer,
    MaintenanceSerializer,
    MasterOperationListSerializer,
    MasterOperationSerializer,
    NodeChangeSerializer,
    NodeImageListSerializer,
    NodeListSerializer,
    NodeSerializer,
    RekeyRequestSerializer,
    RotationSerializer,
    TakeoverSerializer,
    TokenSerializer,
    node_representation,
)
from nodes.models import Node


def _node_answer(node: Node) -> Response:
    statuses = {node.node_id: node_status.read(node)}
    return Response(NodeSerializer(node, context={"statuses": statuses}).data)


def _node_images(node_id: str) -> dict[str, Any]:
    """The images a serving node's Docker engine holds, asked of its agent now; the
    agent's refusals as the API's (docs/operator-guide.md, "Models through /api")."""
    node = Node.objects.filter(node_id=node_id).first()
    if node is None:
        raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
    node_status.require_serving(node, "its images cannot be read now")
    try:
        with AgentClient(node=node) as client:
            answer = client.images()
    except AgentTimeout as exc:
        # A read changes nothing: unlike a command's, its lost answer leaves no doubt.
        raise ServiceError(
            503, "node_unreachable", f"Node {node_id} did not list its images in time."
        ) from exc
    except AgentUnreachable as exc:
        raise ServiceError(503, "node_unreachable", str(exc)) from exc  # it names the node
    except AgentRefused as exc:
        if exc.status == 404 and exc.code == "not_found":
            # An agent from before GET /agent/v1/images has no such route.
            raise ServiceError(
                501,
                "not_supported",
                f"Node {node_id}: its agent cannot list images; upgrade the agent.",
            ) from exc
        status = exc.status if exc.status in (501, 503) else 502
        raise ServiceError(status, exc.code, f"Node {node_id}: {exc.message}") from exc
    images = answer.get("images") if isinstance(answer, dict) else None
    if not isinstance(images, list) or not all(isinstance(i, dict) for i in images):
        raise ServiceError(
            502, "unexpected_answer", f"Node {node_id}: the agent's image list is malformed."
        )
    return {"node": node.node_id, "images": images, "truncated": bool(answer.get("truncated"))}


@extend_schema(tags=["nodes"])
class NodeViewSet(viewsets.GenericViewSet):
    """The nodes, with commands as actions: approve, revoke, drain, undrain, rekey, rotate,
    maintenance; the operations the master sent to each, and the images each holds."""

    queryset = Node.objects.all()
    serializer_class = NodeSerializer
    lookup_field = "node_id"

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "state",
                OpenApiTypes.STR,
                many=True,
                description="Only nodes in these effective states (repeat it, or a comma "
                f"list): {', '.join(listing.STATES)}.",
            ),
            OpenApiParameter(
                "model",
                OpenApiTypes.STR,
                description="Only nodes holding a replica of this model (served name or id).",
            ),
            OpenApiParameter(
                "search",
                OpenApiTypes.STR,
                description="A substring (any case) of the id, name, address, OS, "
                "architecture or a reason code; at most 100 characters.",
            ),
            *PAGE_PARAMETERS,
        ],
        responses={200: NodeListSerializer, **errors(400)},
        description="Every node matching the filters, by id (all of them up to "
        f"{paging.UNPAGED_MAX} without `limit`); `count` is how many match "
        '(docs/operator-guide.md, "Node and model lists").',
    )
    def list(self, request: Request) -> Response:
        wanted = listing.parse_filter(request.query_params)
        window = paging.window(request.query_params)
        found = listing.select_values(wanted, window)
        stale, as_of = status_cache.oldest_as_of(found.statuses)
        listed = [node_representation(n, found.statuses.get(n.node_id) or {}) for n in found.nodes]
        return Response(
            {
                "nodes": listed,
                "stale": stale,
                "statusAsOf": as_of,
                "count": found.count,
                "offset": window.offset,
                "limit": window.limit,
                "next": window.next_offset(found.count),
            }
        )

    @extend_schema(responses={200: NodeSerializer, **errors(404)})
    def retrieve(self, request: Request, node_id: str) -> Response:
        node = Node.objects.filter(node_id=node_id).first()
        if node is None:
            raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
        return _node_answer(node)

    @extend_schema(
        request=NodeChangeSerializer,
        responses={200: NodeSerializer, **errors(400, 404)},
        description="Change what admission keeps free (memoryReserveBytes, gpuReserves) "
        "and the node's labels (labels, replaced whole).",
    )
    def partial_update(self, request: Request, node_id: str) -> Response:
        body = parse(NodeChangeSerializer, request.data)
        with transaction.atomic():  # a refused reserve leaves the labels as they were
            if body.get("labels") is not None:
                node_labels.set_labels(node_id, body["labels"])
            node = services.set_reserves(
                node_id,
                memory_reserve=body.get("memoryReserveBytes"),
                gpu_reserves=body.get("gpuReserves"),
                unknown=[],  # the serializer refused them
            )
        return _node_answer(node)

    @extend_schema(request=None, responses={200: NodeSerializer, **errors(404, 409)})
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, node_id: str) -> Response:
        return _node_answer(services.approve_node(node_id))

    @extend_schema(request=None, responses={200: NodeSerializer, **errors(404)})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, node_id: str) -> Response:
        return _node_answer(services.revoke_node(node_id))

    @extend_schema(request=None, responses={200: NodeSerializer, **errors(404)})
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, node_id: str) -> Response:
        return _node_answer(services.set_draining(node_id, True))

    @extend_schema(request=None, responses={200: NodeSerializer, **errors(404)})
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, node_id: str) -> Response:
        return _node_answer(services.set_draining(node_id, False))

    @extend_schema(
        request=RekeyRequestSerializer,
        responses={201: TokenSerializer, **errors(400, 404, 409)},
        description="A single-use token to re-enroll a node that lost its key.",
    )
    @action(detail=True, methods=["post"])
    def rekey(self, request: Request, node_id: str) -> Response:
        body = parse(RekeyRequestSerializer, request.data)
        result = services.rekey_node(node_id, lifetime_minutes=body.get("lifetimeMinutes"))
        return Response(result, status=201)

    @extend_schema(
        request=None,
        responses={202: RotationSerializer, **errors(404, 409, 501)},
        description="Renew the node's certificate now (two-phase; docs/operator-guide.md).",
    )
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, node_id: str) -> Response:
        opened = rotation.rotate_now(node_id, actor=audit.current_origin().actor)
        return Response(RotationSerializer(opened).data, status=202)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "state",
                OpenApiTypes.STR,
                enum=["", "open", "succeeded", "failed"],
                description="Only operations in this state; empty or left out: every state.",
            ),
            OpenApiParameter(
                "limit",
                INT_OR_EMPTY,
                description=f"At most this many, 1 to {master_operations.PAGE_MAX} "
                f"({master_operations.PAGE_DEFAULT} when left out).",
            ),
        ],
        responses={200: MasterOperationListSerializer, **errors(400, 404)},
        description="The mutations the master sent to the node, newest first "
        '(docs/operator-guide.md, "Operations the master sends").',
    )
    @action(detail=True, methods=["get"])
    def operations(self, request: Request, node_id: str) -> Response:
        rows, more = master_operations.page(
            node_id,
            state=request.query_params.get("state"),
            limit=request.query_params.get("limit"),
        )
        listed = MasterOperationSerializer(rows, many=True).data
        return Response({"operations": listed, "more": more})

    @extend_schema(
        responses={200: NodeImageListSerializer, **errors(404, 501, 502, 503)},
        description="The container images the node's Docker engine holds, read from its "
        "agent now: 501 not_supported on a node without DockerEnabled, 503 "
        "node_not_serving, node_unreachable or docker_unavailable "
        '(docs/operator-guide.md, "Models through /api").',
    )
    @action(detail=True, methods=["get"])
    def images(self, request: Request, node_id: str) -> Response:
        return Response(NodeImageListSerializer(_node_images(node_id)).data)

    @extend_schema(
        request=MaintenanceSerializer,
        responses={200: NodeSerializer, **errors(400, 404)},
        description="Hold the node out of /v1 for `seconds`, with a `reason`.",
    )
    @action(detail=True, methods=["post"])
    def maintenance(self, request: Request, node_id: str) -> Response:
        body = parse(MaintenanceSerializer, request.data)
        node = services.start_maintenance(
            node_id, seconds=body.get("seconds"), reason=body.get("reason", "")
        )
        return _node_answer(node)

    @extend_schema(request=None, responses={200: NodeSerializer, **errors(404)})
    @maintenance.mapping.delete
    def end_maintenance(self, request: Request, node_id: str) -> Response:
        return _node_answer(services.end_maintenance(node_id))


@extend_schema(tags=["nodes"])
class JoinTokenView(GenericAPIView):
    """POST /api/join-tokens: a single-use token, shown once, and the join command."""

    serializer_class = JoinTokenRequestSerializer

    @extend_schema(
        request=JoinTokenRequestSerializer,
        responses={201: TokenSerializer, **errors(400, 409)},
    )
    def post(self, request: Request) -> Response:
        body = parse(JoinTokenRequestSerializer, request.data)
        result = services.create_join_token(
            node_id=body.get("nodeId"), lifetime_minutes=body.get("lifetimeMinutes")
        )
        return Response(result, status=201)


@extend_schema(tags=["nodes"])
class TakeoverView(GenericAPIView):
    """POST /api/takeover: the operator's explicit fencing takeover."""

    serializer_class = TakeoverSerializer

    @extend_schema(request=None, responses={200: TakeoverSerializer, **errors(503)})
    def post(self, request: Request) -> Response:
        return Response(takeover.takeover())


@extend_schema(tags=["model-folders"])
class ModelFolderGguf(GenericAPIView):
    """GET /api/model-folders/{folder}/gguf?file=&node=: a GGUF header summary from a node."""

    @extend_schema(
        parameters=[
            OpenApiParameter("folder", OpenApiTypes.STR, OpenApiParameter.PATH),
            OpenApiParameter("file", OpenApiTypes.STR, description="The .gguf file to read."),
            OpenApiParameter("node", OpenApiTypes.STR, description="Needed with several nodes."),
        ],
        responses={200: OpenApiTypes.OBJECT, **errors(400, 404, 409, 422, 501, 502, 503)},
    )
    def get(self, request: Request, folder: str) -> Response:
        return Response(
            services.read_gguf(
                node_param=request.query_params.get("node"),
                folder=folder,
                file=request.query_params.get("file"),
            )
        )
