"""/api/downloads, /api/model-folders and /api/reclaim (thin; models_registry.downloads decides).

The answers are the node's own records (models_registry.downloads passes them on),
so the schema names them as objects; the bodies are checked by serializers.
"""

from __future__ import annotations

from urllib.parse import quote

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from core.api_serializers import errors, parse
from models_registry import downloads
from models_registry.api.serializers import DownloadRequestSerializer, ReclaimRequestSerializer
from models_registry.api.views import AGENT_ERRORS

_NODE = OpenApiParameter(
    "node", OpenApiTypes.STR, description="The node; may be left out when there is one."
)
_FOLDER = OpenApiParameter("folder", OpenApiTypes.STR, OpenApiParameter.PATH)
_NODE_ERRORS = AGENT_ERRORS
_HUB_ERRORS = errors(400, 403, 404, 502)


def _node(request: Request) -> str | None:
    return request.query_params.get("node")


@extend_schema(tags=["downloads"], parameters=[_NODE])
class DownloadViewSet(viewsets.ViewSet):
    """Hugging Face downloads on a node; ``inspect`` reads the hub (no ``?node=``)."""

    lookup_url_kwarg = "folder"

    @extend_schema(
        operation_id="downloads_list", responses={200: OpenApiTypes.OBJECT, **_NODE_ERRORS}
    )
    def list(self, request: Request) -> Response:
        return Response(downloads.list_downloads(_node(request)))

    @extend_schema(
        request=DownloadRequestSerializer,
        responses={202: OpenApiTypes.OBJECT, **_NODE_ERRORS, **_HUB_ERRORS},
    )
    def create(self, request: Request) -> Response:
        body = parse(DownloadRequestSerializer, request.data)
        result = downloads.start_download(_node(request), body)
        response = Response(result, status=202)
        location = f"/api/downloads/{quote(result['folder'])}"
        if _node(request):
            # The scope is echoed only when the caller named it (docs/operator-guide.md, "Models through /api").
            location += f"?node={quote(result['node'])}"
        response["Location"] = location
        return response

    @extend_schema(parameters=[_FOLDER], responses={200: OpenApiTypes.OBJECT, **_NODE_ERRORS})
    def retrieve(self, request: Request, folder: str) -> Response:
        return Response(downloads.get_download(_node(request), folder))

    @extend_schema(parameters=[_FOLDER], responses={200: OpenApiTypes.OBJECT, **_NODE_ERRORS})
    def destroy(self, request: Request, folder: str) -> Response:
        return Response(downloads.cancel_download(_node(request), folder))

    @extend_schema(
        parameters=[
            OpenApiParameter("repo", OpenApiTypes.STR, description="org/name of the repo."),
            OpenApiParameter("revision", OpenApiTypes.STR, description="'main' by default."),
            OpenApiParameter(
                "X-HF-Token",
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                description="A token for a private repo; never in the URL.",
            ),
        ],
        responses={200: OpenApiTypes.OBJECT, **_HUB_ERRORS},
        description="The repo's GGUF variants and the commit the revision names.",
    )
    @action(detail=False, methods=["get"])
    def inspect(self, request: Request) -> Response:
        q = request.query_params
        token = request.headers.get("X-HF-Token")
        return Response(downloads.inspect(q.get("repo"), q.get("revision"), token))


@extend_schema(tags=["model-folders"], parameters=[_NODE])
class ModelFolderViewSet(viewsets.ViewSet):
    """A node's weights: folders, files, sizes, which ones the system fetched."""

    lookup_url_kwarg = "folder"

    @extend_schema(
        operation_id="model_folders_list", responses={200: OpenApiTypes.OBJECT, **_NODE_ERRORS}
    )
    def list(self, request: Request) -> Response:
        return Response(downloads.model_folders(_node(request)))

    @extend_schema(parameters=[_FOLDER], responses={200: OpenApiTypes.OBJECT, **_NODE_ERRORS})
    def retrieve(self, request: Request, folder: str) -> Response:
        return Response(downloads.model_folder(_node(request), folder))


@extend_schema(tags=["model-folders"])
class ReclaimViewSet(viewsets.ViewSet):
    """Fetched folders no model uses: list them, or ask a node to delete some."""

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def list(self, request: Request) -> Response:
        return Response(downloads.reclaimable())

    @extend_schema(
        request=ReclaimRequestSerializer,
        responses={200: OpenApiTypes.OBJECT, **_NODE_ERRORS},
    )
    def create(self, request: Request) -> Response:
        return Response(downloads.reclaim(parse(ReclaimRequestSerializer, request.data)))
