"""The weights routes: a folder's GGUF header, downloads, the model-folder inventory and
reclaim (docs/agent-api.md "Downloads", "Model folders"). The server composes them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from agent._errors import ApiError, DownloadRunning, InvalidRequest, NotFound
from agent.engines import check_folder_name, confined_path, resolve_model_path
from agent.http._complete import complete
from agent.http._json import read_json
from agent.weights import DownloadManager, Weights, is_model_file, read_summary

__all__ = ["WeightRoutes"]


class WeightRoutes:
    """Handlers over the node's models root, its downloads and its inventory."""

    def __init__(self, *, models_root: Path, weights: Weights, downloads: DownloadManager) -> None:
        self._models_root = models_root
        self.weights = weights
        self.downloads = downloads

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get("/agent/v1/folders/{folder}/gguf", self.handle_gguf)
        r.add_get("/agent/v1/downloads", self.handle_downloads)
        r.add_post("/agent/v1/downloads", self.handle_download_start)
        r.add_get("/agent/v1/downloads/{folder}", self.handle_download)
        r.add_delete("/agent/v1/downloads/{folder}", self.handle_download_cancel)
        r.add_get("/agent/v1/model-folders", self.handle_model_folders)
        r.add_delete("/agent/v1/model-folders/{folder}", self.handle_model_folder_reclaim)

    async def handle_gguf(self, request: web.Request) -> web.Response:
        """The header summary of a GGUF in a model folder, read under hard bounds."""
        folder = request.match_info["folder"]
        file = request.query.get("file")
        root = self._models_root
        if file is None:
            # Listed only once the folder, symlinks resolved, lies inside the root: the
            # candidates of a folder linked elsewhere would name files outside it.
            directory = confined_path(root, check_folder_name(folder))
            if not directory.is_dir():
                raise NotFound(f"model folder {folder!r} does not exist on this node")
            candidates = sorted(
                p.name for p in directory.iterdir() if is_model_file(p.name) and p.is_file()
            )
            if not candidates:
                raise NotFound(f"model folder {folder!r} holds no model GGUF")
            if len(candidates) > 1:
                # The list is also structured: a file name may itself contain a comma.
                raise InvalidRequest(
                    f"'{folder}' has several model GGUFs; choose one with ?file=: "
                    + ", ".join(candidates),
                    details={"candidates": candidates},
                )
            file = candidates[0]
        try:
            path = resolve_model_path(root, folder, file)
        except ApiError as exc:
            raise NotFound(exc.message) from None
        summary = await asyncio.to_thread(read_summary, path)
        return web.json_response({"folder": folder, "file": file, **summary})

    async def handle_downloads(self, request: web.Request) -> web.Response:
        return web.json_response({"downloads": self.downloads.list()})

    async def handle_download_start(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        download = await complete(self.downloads.create(body))
        return web.json_response(download, status=202)

    async def handle_download(self, request: web.Request) -> web.Response:
        return web.json_response(self.downloads.get(request.match_info["folder"]))

    async def handle_download_cancel(self, request: web.Request) -> web.Response:
        download = await complete(self.downloads.cancel(request.match_info["folder"]))
        return web.json_response(download)

    async def handle_model_folders(self, request: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(self.weights.inventory))

    async def handle_model_folder_reclaim(self, request: web.Request) -> web.Response:
        folder = request.match_info["folder"]
        if folder in self.downloads.active_folders():
            raise DownloadRunning(f"a download for folder {folder!r} is running; DELETE it first")
        # The checks read the runtime's instances, so they run here, on the loop; only
        # the unlinking goes to a thread.
        plan = self.weights.check_reclaim(folder)
        return web.json_response(await asyncio.to_thread(self.weights.carry_out, plan))
