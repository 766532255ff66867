"""/api/downloads, /api/model-folders and /api/reclaim (thin; models_registry.downloads decides)."""

from __future__ import annotations

from urllib.parse import quote

from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from models_registry import downloads


def _node(request: Request) -> str | None:
    return request.query_params.get("node")


class DownloadList(APIView):
    def get(self, request: Request) -> Response:
        return Response(downloads.list_downloads(_node(request)))

    def post(self, request: Request) -> Response:
        result = downloads.start_download(_node(request), request.data)
        response = Response(result, status=202)
        location = f"/api/downloads/{quote(result['folder'])}"
        if _node(request):
            # The scope is echoed only when the caller named it (docs/operator-guide.md, "Models through /api").
            location += f"?node={quote(result['node'])}"
        response["Location"] = location
        return response


class DownloadDetail(APIView):
    def get(self, request: Request, folder: str) -> Response:
        return Response(downloads.get_download(_node(request), folder))

    def delete(self, request: Request, folder: str) -> Response:
        return Response(downloads.cancel_download(_node(request), folder))


class DownloadInspect(APIView):
    """GET /api/downloads/inspect?repo=&revision=: the repo's GGUF variants (no ?node=).

    A token for a private repo comes in the ``X-HF-Token`` header, never the URL.
    """

    def get(self, request: Request) -> Response:
        q = request.query_params
        token = request.headers.get("X-HF-Token")
        return Response(downloads.inspect(q.get("repo"), q.get("revision"), token))


class ModelFolderList(APIView):
    def get(self, request: Request) -> Response:
        return Response(downloads.model_folders(_node(request)))


class ModelFolderDetail(APIView):
    def get(self, request: Request, folder: str) -> Response:
        return Response(downloads.model_folder(_node(request), folder))


class Reclaim(APIView):
    def get(self, request: Request) -> Response:
        return Response(downloads.reclaimable())

    def post(self, request: Request) -> Response:
        return Response(downloads.reclaim(request.data))
