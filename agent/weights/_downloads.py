"""Hugging Face downloads into the models root (feature ``downloads.hf-native``).

A download fetches the files of one repo at one commit that match the allow-patterns
into ``{ModelsRoot}/{folder}.partial/``, verifies each one, writes the manifest
``.mirbad-fetched.json`` (the source, and every file's name, size and SHA-256), and
renames the directory to ``{ModelsRoot}/{folder}`` in one step, so a folder is either
absent or complete. The manifest is what marks a folder as fetched by the system;
:mod:`agent.weights._inventory` reclaims only such folders.

This module owns the API's logic (the checks and refusals of POST, GET and DELETE
/downloads), the asyncio tasks (at most ``max_running`` at once, the rest Queued),
the layout in the models root and ``{StateDirectory}/downloads.json``. The hub side,
and why the bytes move through aiohttp rather than ``hf_hub_download``, is in
:mod:`agent.weights._hubfetch`; the records are in :mod:`agent.weights._download_state`.

Disk space: a download is refused up front (409 ``insufficient_disk``) when the bytes it
still needs, plus what the other Queued and Running downloads still need, plus the
reserve (``DownloadReserveBytes``) are more than the models disk has free; the check
runs again when a Queued download gets its turn. A write that does not fit all the
same (something else filled the disk) fails the download with the numbers; its bytes
stay in ``.partial`` for a resume, and ``downloads.json`` is only ever replaced whole.

The Hugging Face token arrives in the POST body and lives only on the in-memory
:class:`~agent.weights._download_state.Download`: never in ``downloads.json``, an answer, an
event or a log line, and it is dropped when the download ends. So a restart cannot
resume a download that needed one: it comes back Failed with an error that starts
``Paused (needs token)``, and POSTing it again with the token resumes it from the
bytes in ``.partial``, which the disk pre-check counts as already there.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from agent._errors import (
    ApiError,
    DownloadRunning,
    FolderExists,
    InsufficientDisk,
    NotFound,
    NothingToDownload,
    StateUnavailable,
)
from agent._util import iso_time
from agent.engines import check_folder_name, check_relative_name, confined_path
from agent.state import EventBus
from agent.weights._download_state import (
    ACTIVE,
    CANCELLED,
    COMPLETED,
    FAILED,
    RUNNING,
    Download,
    DownloadRequest,
    parse_request,
)
from agent.weights._hubfetch import DiskFull, DownloadFailed, HubClient
from protocol.atomic import fsync_directory, write_atomic
from protocol.logcap import NO_SPACE

__all__ = ["MANIFEST_NAME", "PARTIAL_SUFFIX", "STATE_FILE", "DownloadManager"]

log = logging.getLogger("mirbad.agent.downloads")

MANIFEST_NAME = ".mirbad-fetched.json"
# Inside .partial: which source the bytes there belong to, so a POST for the same
# folder from another repo or commit never resumes onto foreign bytes.
MARKER_NAME = ".mirbad-download.json"
PARTIAL_SUFFIX = ".partial"
STATE_FILE = "downloads.json"
RESTART_NEEDS_TOKEN = "Paused (needs token)"  # noqa: S105 - an error prefix, not a secret
RESTART_INTERRUPTED = "Interrupted by an agent restart"
RECENT_SECONDS = 600.0
KEEP_FINISHED = 200
_GIB = 1024**3


def _free_bytes(path: Path) -> int:
    return int(psutil.disk_usage(str(path)).free)


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f} GiB ({value} bytes)"


class DownloadManager:
    """Every download of this agent: the API's logic, the tasks, ``downloads.json``."""

    def __init__(
        self,
        *,
        models_root: Path,
        state_directory: Path,
        bus: EventBus,
        endpoint: str | None = None,
        free_bytes: Callable[[Path], int] = _free_bytes,
        reserve_bytes: int = 0,
        max_running: int = 2,
        progress_interval: float = 0.5,
        retry_delay: float = 1.0,
        metadata_timeout: float = 30.0,
        on_finished: Callable[[], None] | None = None,
    ) -> None:
        self.models_root = models_root
        self._bus = bus
        self._endpoint = endpoint
        self._free_bytes = free_bytes
        self.reserve_bytes = reserve_bytes
        self._slots = asyncio.Semaphore(max_running)
        self._interval = progress_interval
        self._on_finished = on_finished
        self._state_file = state_directory / STATE_FILE
        self._downloads: dict[str, Download] = {}
        self._claimed: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._hub = HubClient(
            endpoint=lambda: self.endpoint,
            session=self._live_session,
            retry_delay=retry_delay,
            metadata_timeout=metadata_timeout,
        )

    def _live_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the download manager is not started")
        return self._session

    @property
    def endpoint(self) -> str:
        """The hub: the constructor's, else HF_ENDPOINT read now, else huggingface.co."""
        if self._endpoint:
            return self._endpoint.rstrip("/")
        from huggingface_hub import constants

        return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Load ``downloads.json``; what was going when the agent stopped is Failed now."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120),
            trust_env=True,
        )
        records = await asyncio.to_thread(self._load)
        changed = False
        for record in records:
            try:
                download = Download.from_record(record)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("Skipped a malformed record in %s: %s", self._state_file, exc)
                continue
            if download.state in ACTIVE:
                self._mark_interrupted(download)
                changed = True
            if download.state != COMPLETED:
                self._count_partial(download)
            self._downloads[download.folder] = download
        if changed:
            # A state directory that cannot be written shows as state_unavailable in
            # the health reasons; it does not stop the agent from starting.
            self._persist_quietly()

    async def close(self) -> None:
        """Stop every download (their bytes stay in ``.partial``) and the HTTP session."""
        for download in list(self._downloads.values()):
            if download.state in ACTIVE and download.task is not None:
                self._mark_interrupted(download)
                download.cancelling = True
                download.task.cancel()
        for download in list(self._downloads.values()):
            if download.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await download.task
        self._persist_quietly()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _mark_interrupted(self, download: Download) -> None:
        done = download.bytes_done
        if download.token is not None or download.needs_token:
            download.error = (
                f"{RESTART_NEEDS_TOKEN}: the agent restarted, and it never keeps a Hugging "
                "Face token; POST the download again with the token to resume from the "
                f"{done} bytes already in {download.folder}{PARTIAL_SUFFIX}"
            )
            download.needs_token = True
        else:
            download.error = (
                f"{RESTART_INTERRUPTED}; POST the download again to resume from the {done} "
                f"bytes already in {download.folder}{PARTIAL_SUFFIX}"
            )
        download.state = FAILED
        download.finished_at = time.time()
        download.token = None

    def _count_partial(self, download: Download) -> None:
        """Per-file bytes from what ``.partial`` really holds (the record may lag)."""
        partial = self.models_root / (download.folder + PARTIAL_SUFFIX)
        for entry in download.files:
            try:
                size = (partial / entry.name).stat().st_size
            except OSError:
                size = 0
            entry.bytes_done = min(size, entry.size) if entry.size is not None else size
            entry.verified = False

    # -- persistence -----------------------------------------------------------------

    def _load(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            # Downloads are resumable from .partial, so a damaged record costs the list,
            # not the bytes; the agent starts rather than refusing over it.
            log.warning(
                "%s is unreadable (%s); starting with no download records", self._state_file, exc
            )
            return []
        records = data.get("downloads", []) if isinstance(data, dict) else []
        return [r for r in records if isinstance(r, dict)]

    def _persist(self) -> None:
        finished = sorted(
            (d for d in self._downloads.values() if d.state not in ACTIVE),
            key=lambda d: d.finished_at or d.created_at,
        )
        for stale in finished[:-KEEP_FINISHED] if len(finished) > KEEP_FINISHED else []:
            self._downloads.pop(stale.folder, None)
        body = {"version": 1, "downloads": [d.to_record() for d in self._downloads.values()]}
        try:
            write_atomic(self._state_file, json.dumps(body, indent=1).encode(), mode=0o600)
        except OSError as exc:
            raise StateUnavailable(f"cannot persist {self._state_file}: {exc}") from exc

    def _persist_quietly(self) -> None:
        try:
            self._persist()
        except StateUnavailable as exc:
            log.error("%s", exc.message)

    def _publish(self, download: Download, *, force: bool = False) -> None:
        """A ``download`` event: on every state change, else at most one per interval."""
        now = time.monotonic()
        if not force and now - download.last_event < self._interval:
            return
        download.last_event = now
        self._bus.publish("download", download.to_json())

    # -- queries ---------------------------------------------------------------------

    def list(self) -> list[dict[str, Any]]:
        """GET /downloads: every download this agent has a record of."""
        return [d.to_json() for d in self._downloads.values()]

    def get(self, folder: str) -> dict[str, Any]:
        """GET /downloads/{folder}; 404 not_found for a folder without a record."""
        return self._find(folder).to_json()

    def _find(self, folder: str) -> Download:
        check_folder_name(folder)
        download = self._downloads.get(folder)
        if download is None:
            raise NotFound(f"no download for folder {folder!r} on this node")
        return download

    def active_folders(self) -> set[str]:
        """Folders with a download Queued or Running (or being set up)."""
        return {d.folder for d in self._downloads.values() if d.state in ACTIVE} | self._claimed

    # builtins.list: inside this class, plain ``list`` names the method above.
    def heartbeat(self) -> builtins.list[dict[str, Any]]:
        """Compact JSON of the going downloads and those finished in the last 10 minutes."""
        horizon = time.time() - RECENT_SECONDS
        return [
            d.to_json(files=False)
            for d in self._downloads.values()
            if d.state in ACTIVE or (d.finished_at or 0) >= horizon
        ]

    # -- create ----------------------------------------------------------------------

    async def create(self, body: Any) -> dict[str, Any]:
        """POST /downloads: check, size up, and queue; answers the download JSON.

        Refusals (nothing is recorded): 400/501 for the body, 409 ``download_running``,
        ``folder_exists`` or ``insufficient_disk``, 422 ``nothing_to_download``. A hub
        that refuses or cannot be reached is not a refusal of the request: the
        download is recorded Failed with the hub's answer, as a launch that cannot
        spawn is recorded Failed.
        """
        request = parse_request(body)
        folder = request.folder
        target = confined_path(self.models_root, folder)
        partial = confined_path(self.models_root, folder + PARTIAL_SUFFIX)
        if folder in self.active_folders():
            raise DownloadRunning(
                f"a download for folder {folder!r} is already running; wait for it or DELETE it"
            )
        if await asyncio.to_thread(os.path.lexists, target):
            raise FolderExists(
                f"model folder {folder!r} already exists on this node; a download never "
                "writes into an existing folder (reclaim it first if it is ours)"
            )
        self._claimed.add(folder)
        try:
            return await self._create(request, partial)
        finally:
            self._claimed.discard(folder)

    async def _create(self, request: DownloadRequest, partial: Path) -> dict[str, Any]:
        download = Download(
            folder=request.folder,
            repo_id=request.repo_id,
            revision=request.revision,
            allow_patterns=request.allow_patterns,
            files=[],
            token=request.token,
            needs_token=request.token is not None,
        )
        try:
            entries, listing = await asyncio.to_thread(
                self._hub.metadata, request, reserved=(MANIFEST_NAME, MARKER_NAME)
            )
        except DownloadFailed as exc:
            download.state = FAILED
            download.error = str(exc)
            download.needs_token = download.needs_token or exc.needs_token
            download.finished_at = time.time()
            download.token = None
            log.warning("Download %s refused by the hub: %s", request.folder, exc)
            self._downloads[request.folder] = download
            self._persist()
            self._publish(download, force=True)
            return download.to_json()
        if not entries:
            shown = ", ".join(listing[:50]) + (" ..." if len(listing) > 50 else "")
            raise NothingToDownload(
                f"allowPatterns {request.allow_patterns!r} select no file of "
                f"{request.repo_id} at {request.revision}; its files are: {shown or '(none)'}",
                details={"files": listing},
            )
        download.files = entries
        wipe = await asyncio.to_thread(self._inspect_partial, download, partial)
        self._check_disk(download)
        await asyncio.to_thread(self._make_partial, download, partial, wipe=wipe)
        self._downloads[request.folder] = download
        try:
            self._persist()
        except StateUnavailable:
            self._downloads.pop(request.folder, None)
            raise
        log.info(
            "Download %s queued: %s at %s, %d file(s), %s bytes",
            download.folder,
            download.repo_id,
            download.revision,
            len(entries),
            download.bytes_total if download.bytes_total is not None else "unknown",
        )
        self._publish(download, force=True)
        download.task = asyncio.create_task(self._run(download), name=f"download-{download.folder}")
        return download.to_json()

    @staticmethod
    def _source(download: Download) -> dict[str, str]:
        return {"repoId": download.repo_id, "revision": download.revision}

    def _inspect_partial(self, download: Download, partial: Path) -> bool:
        """Count the bytes ``.partial`` already holds for this source; True: discard it.

        Bytes left by a download of another repo or commit are not a prefix of these
        files, so they count as nothing and are discarded once the disk check passed.
        A ``.partial`` without our marker was not made by this agent and is refused.
        """
        if not partial.is_dir():
            if os.path.lexists(partial):
                raise FolderExists(f"{partial.name} exists and is not a directory")
            return False
        try:
            found = json.loads((partial / MARKER_NAME).read_text())
        except (OSError, ValueError):
            raise FolderExists(
                f"{partial.name} exists but was not started by this agent (no {MARKER_NAME}); "
                f"remove it by hand if you mean to download {download.folder!r}"
            ) from None
        if found != self._source(download):
            return True
        self._count_partial(download)
        return False

    def _make_partial(self, download: Download, partial: Path, *, wipe: bool) -> None:
        if wipe:
            log.info(
                "%s held bytes of another source; discarded for %s at %s",
                partial.name,
                download.repo_id,
                download.revision,
            )
            shutil.rmtree(partial)
        partial.mkdir(mode=0o755, exist_ok=True)
        marker = partial / MARKER_NAME
        if not marker.exists():
            write_atomic(marker, json.dumps(self._source(download)).encode(), mode=0o644)

    def _check_disk(self, download: Download) -> None:
        """Refuse (409 insufficient_disk) a download that would not leave the reserve free.

        Counted: this download's bytes still to fetch, and those of every other Queued
        or Running one, which will land on the same disk. An unknown size cannot be
        counted; a write that does not fit then fails the download instead.
        """
        total = download.bytes_total
        if total is None:
            return
        needed = max(0, total - download.bytes_done)
        others = sum(
            max(0, (d.bytes_total or 0) - d.bytes_done)
            for d in self._downloads.values()
            if d.state in ACTIVE and d is not download
        )
        free = self._free_bytes(self.models_root)
        if needed + others + self.reserve_bytes <= free:
            return
        short = needed + others + self.reserve_bytes - free
        pending = f", the other downloads under way {_gib(others)}" if others else ""
        raise InsufficientDisk(
            f"download {download.folder!r} needs {_gib(needed)} more{pending}, and "
            f"DownloadReserveBytes keeps {_gib(self.reserve_bytes)} free, but the models "
            f"root {self.models_root} has {_gib(free)} free; free {_gib(short)} there (or "
            "pick a smaller variant, or lower DownloadReserveBytes) and POST it again",
            details={
                "neededBytes": needed,
                "freeBytes": free,
                "reserveBytes": self.reserve_bytes,
                "otherDownloadsBytes": others,
            },
        )

    def _disk_full(self, download: Download, exc: DiskFull | OSError) -> str:
        """The error of a download whose write did not fit: the numbers, and what to do."""
        try:
            free = _gib(self._free_bytes(self.models_root))
        except OSError:
            free = "an unknown amount"
        total = download.bytes_total
        needed = _gib(max(0, total - download.bytes_done)) if total is not None else "more"
        what = str(exc) if isinstance(exc, DiskFull) else (exc.strerror or str(exc))
        return (
            f"the models disk is full ({what}): the download still needs {needed}, and "
            f"{self.models_root} has {free} free; the {download.bytes_done} bytes already "
            f"written stay in {download.folder}{PARTIAL_SUFFIX}. Free space there and POST "
            "the download again to resume, or DELETE it to remove those bytes"
        )

    # -- cancel ----------------------------------------------------------------------

    async def cancel(self, folder: str) -> dict[str, Any]:
        """DELETE /downloads/{folder}: stop it, remove ``.partial`` and forget it.

        A Completed download's record is forgotten and its folder left where it is
        (reclaiming weights is DELETE /model-folders); the answer keeps its state.
        """
        download = self._find(folder)
        partial = confined_path(self.models_root, folder + PARTIAL_SUFFIX)
        if download.task is not None and not download.task.done():
            download.cancelling = True
            download.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await download.task
        if download.state != COMPLETED:
            if partial.is_dir() and (partial / MARKER_NAME).exists():
                await asyncio.to_thread(shutil.rmtree, partial)
            download.state = CANCELLED
            download.finished_at = time.time()
            download.error = None
        download.token = None
        self._downloads.pop(folder, None)
        self._persist()
        log.info("Download %s cancelled and forgotten", folder)
        self._publish(download, force=True)
        return download.to_json()

    # -- the task --------------------------------------------------------------------

    async def _run(self, download: Download) -> None:
        try:
            async with self._slots:
                download.state = RUNNING
                download.started_at = time.time()
                download.rate.reset()
                download.rate.add(time.monotonic(), download.bytes_done)
                # It may have queued for a while: the disk is checked again, now.
                self._check_disk(download)
                self._persist_quietly()
                self._publish(download, force=True)
                log.info("Download %s started", download.folder)
                await self._fetch_all(download)
                await asyncio.to_thread(self._finalize, download)
                download.state = COMPLETED
                download.error = None
                log.info("Download %s completed (%d bytes)", download.folder, download.bytes_done)
        except asyncio.CancelledError:
            if not download.cancelling:
                raise
            return  # cancel() or close() set the state and persist it
        except DownloadFailed as exc:
            download.state = FAILED
            download.error = str(exc)
            download.needs_token = download.needs_token or exc.needs_token
            log.warning("Download %s failed: %s", download.folder, exc)
        except ApiError as exc:
            download.state = FAILED
            download.error = exc.message
            log.warning("Download %s failed: %s", download.folder, exc.message)
        except Exception as exc:
            download.state = FAILED
            if isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in NO_SPACE):
                # A write into .partial, a folder or the manifest did not fit.
                download.error = self._disk_full(download, exc)
                log.warning("Download %s failed: %s", download.folder, download.error)
            else:
                download.error = f"unexpected error: {type(exc).__name__}: {exc}"
                log.exception("Download %s failed unexpectedly", download.folder)
        download.finished_at = time.time()
        download.token = None
        self._persist_quietly()
        self._publish(download, force=True)
        if self._on_finished is not None:
            self._on_finished()

    async def _fetch_all(self, download: Download) -> None:
        partial = confined_path(self.models_root, download.folder + PARTIAL_SUFFIX)
        for entry in download.files:
            # Confined to .partial itself: a symlink in there may not even lead into
            # another model folder.
            path = confined_path(partial, check_relative_name(entry.name, "file"))
            await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            await self._hub.fetch_file(download, entry, path, tick=lambda: self._tick(download))

    def _tick(self, download: Download) -> None:
        now = time.monotonic()
        if now - download.last_event >= self._interval:
            download.rate.add(now, download.bytes_done)
            self._publish(download)

    def _finalize(self, download: Download) -> None:
        """Manifest, fsync, then rename ``.partial`` to the folder in one step."""
        partial = confined_path(self.models_root, download.folder + PARTIAL_SUFFIX)
        target = confined_path(self.models_root, download.folder)
        manifest = {
            "version": 1,
            "fetchedBy": "mirbadllm-agent",
            "fetchedAt": iso_time(time.time()),
            "source": {
                "type": "huggingface",
                "repoId": download.repo_id,
                "revision": download.revision,
                "allowPatterns": download.allow_patterns,
            },
            "files": [
                {"name": f.name, "size": f.bytes_done, "sha256": f.sha256} for f in download.files
            ],
        }
        write_atomic(partial / MANIFEST_NAME, json.dumps(manifest, indent=1).encode(), mode=0o644)
        with contextlib.suppress(FileNotFoundError):
            (partial / MARKER_NAME).unlink()
        directories = {partial}
        for entry in download.files:
            parent = (partial / entry.name).parent
            while parent != partial:
                directories.add(parent)
                parent = parent.parent
        for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
            fsync_directory(directory)
        if os.path.lexists(target):
            raise FolderExists(
                f"model folder {download.folder!r} appeared while it was downloading; the "
                f"verified files stay in {partial.name}"
            )
        os.rename(partial, target)
        fsync_directory(target.parent)
