"""Talking to the Hugging Face hub for a download: metadata, bytes, verification.

Division of labour with ``huggingface_hub``:

- the library answers the metadata: ``HfApi(endpoint=...).model_info(...,
  files_metadata=True)`` gives the commit, every file's size, its git blob id and, for
  LFS files, the SHA-256; ``filter_repo_objects`` applies the allow-patterns exactly
  as ``snapshot_download`` would; ``hf_hub_url`` builds each file's resolve URL and
  ``build_hf_headers`` the user agent and the Authorization header;
- the bytes are moved here, with aiohttp and HTTP Range. ``hf_hub_download`` writes
  either into the hub cache (blobs plus symlinks) or into a ``local_dir`` with its own
  ``.cache/huggingface`` bookkeeping, neither of which is the ``.partial`` directory
  renamed whole that a download needs; it blocks a thread, so a DELETE could not stop
  it mid-file; and it offers no per-chunk hook for progress events and the rate. On
  the agent's event loop a cancel takes effect at the next chunk.

Resume: what a file already has in ``.partial`` is read back into the hashes, then
only the rest is asked for (``Range: bytes=N-``), so the digest always covers the
whole file. A drop, a timeout or a 5xx is retried a few times from where the file
stopped. A 200 to a Range request (a server that ignores ranges) starts the file over.
LFS files must match the hub's SHA-256, small files their size and git blob id; a
mismatch deletes the file and fails naming the file and both digests.

A write that does not fit (ENOSPC, EDQUOT) is taken back to the last whole write, so
the file on disk is exactly the bytes hashed so far, and raises :class:`DiskFull`;
the manager fails the download with how much is needed and free, and the bytes
written stay in ``.partial`` for a resume.

The endpoint is passed explicitly on every call: ``huggingface_hub`` reads
``HF_ENDPOINT`` once at import, and the agent reads it per download.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import aiohttp

from agent._errors import InvalidRequest
from agent._version import __version__
from agent.engines import check_relative_name
from agent.weights._download_state import Download, DownloadRequest, FileEntry
from protocol.logcap import NO_SPACE

__all__ = ["DiskFull", "DownloadFailed", "FileSink", "HubClient", "hub_refusal"]

log = logging.getLogger("mirbad.agent.downloads")

LIBRARY_NAME = "mirbadllm-agent"
_CHUNK = 1 << 20
# Bytes gathered before one write+hash in a worker thread: large enough that the
# thread hop is cheap, small enough that a cancel or a drop loses little.
FLUSH_BYTES = 4 << 20


class DownloadFailed(Exception):
    """A download cannot go on; the message is the record's ``error``."""

    def __init__(self, message: str, *, needs_token: bool = False) -> None:
        self.needs_token = needs_token
        super().__init__(message)


class DiskFull(Exception):
    """A write into ``.partial`` did not fit on the models disk; nothing of it is kept."""

    def __init__(self, entry: FileEntry, offset: int, error: OSError) -> None:
        self.entry = entry
        self.offset = offset
        self.strerror = error.strerror or str(error)
        super().__init__(f"{entry.name}: {self.strerror} after byte {offset}")


class _Transient(Exception):
    """A failure worth retrying from where the file stopped (drop, timeout, 5xx)."""


class FileSink:
    """One file being written in ``.partial``, with the hashes over all of its bytes."""

    def __init__(self, path: Path, entry: FileEntry) -> None:
        with contextlib.suppress(FileNotFoundError):
            if entry.size is not None and path.stat().st_size > entry.size:
                # Longer than the file can be: not a prefix of it, so not resumable.
                path.unlink()
        self.path = path
        self.entry = entry
        # Unbuffered: what write() returns from is on the file, nothing waits in a buffer
        # that a later flush could fail to write.
        self.handle: IO[bytes] = open(path, "ab", buffering=0)  # closed by close()
        self.offset = 0
        self._new_hashes()

    def _new_hashes(self) -> None:
        self.sha256 = hashlib.sha256()
        self.git: Any = None
        if not self.entry.lfs and self.entry.blob_id and self.entry.size is not None:
            # The git object id of a small file is SHA-1 over "blob <size>\0" + bytes.
            self.git = hashlib.sha1(usedforsecurity=False)
            self.git.update(b"blob %d\0" % self.entry.size)

    def read_prefix(self) -> int:
        """Hash what is already on disk (a resumed file); returns its length."""
        with open(self.path, "rb") as existing:
            while block := existing.read(FLUSH_BYTES):
                self._hash(block)
                self.offset += len(block)
        return self.offset

    def _hash(self, data: bytes) -> None:
        self.sha256.update(data)
        if self.git is not None:
            self.git.update(data)

    def write(self, data: bytes) -> None:
        """Append bytes that arrived, hashing them; DiskFull when they do not fit.

        A write that failed part-way is cut back to ``offset``: the file holds exactly
        the bytes hashed, so a resume reads a true prefix.
        """
        view = memoryview(data)
        try:
            while view:
                view = view[self.handle.write(view) or 0 :]
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            os.ftruncate(self.handle.fileno(), self.offset)  # shrinking needs no space
            raise DiskFull(self.entry, self.offset, exc) from None
        self._hash(data)
        self.offset += len(data)

    def restart(self) -> None:
        """Throw away what is there (the server sent the whole file, not the range)."""
        self.handle.truncate(0)
        self.handle.seek(0)
        self.offset = 0
        self._new_hashes()

    def close(self, *, sync: bool) -> None:
        """Close the file, fsynced first when ``sync`` (a complete file); idempotent."""
        if self.handle.closed:
            return
        try:
            if sync:
                os.fsync(self.handle.fileno())
        finally:
            self.handle.close()


class HubClient:
    """The hub side of downloads: one per download manager."""

    def __init__(
        self,
        *,
        endpoint: Callable[[], str],
        session: Callable[[], aiohttp.ClientSession],
        retry_delay: float = 1.0,
        metadata_timeout: float = 30.0,
        attempts: int = 5,
    ) -> None:
        self._endpoint = endpoint
        self.attempts = attempts
        self.session = session
        self.retry_delay = retry_delay
        self.metadata_timeout = metadata_timeout

    @property
    def endpoint(self) -> str:
        """The hub's base URL, as the manager resolves it now."""
        return self._endpoint()

    def metadata(
        self, request: DownloadRequest, *, reserved: tuple[str, ...] = ()
    ) -> tuple[list[FileEntry], list[str]]:
        """The selected files (sizes, digests) and the repo's whole listing; blocking.

        A file to fetch (one the allow-patterns select) whose name is not a plain
        relative path (protocol.names.check_relative_path), or whose first part is one of
        ``reserved`` (the agent's own bookkeeping names), refuses the whole download with
        400 invalid_request.
        """
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import filter_repo_objects

        api = HfApi(
            endpoint=self.endpoint,
            # False, not None: None would send a token found on this machine, and the
            # only token a download may use is the one the master sent with it.
            token=request.token or False,
            library_name=LIBRARY_NAME,
            library_version=__version__,
        )
        try:
            info = api.model_info(
                request.repo_id,
                revision=request.revision,
                files_metadata=True,
                timeout=self.metadata_timeout,
            )
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            raise DownloadFailed(
                hub_refusal(status, request.repo_id, request.revision, request.token),
                needs_token=status in (401, 403),
            ) from None
        except Exception as exc:
            raise DownloadFailed(
                f"cannot reach the Hugging Face hub at {self.endpoint} for {request.repo_id}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if info.sha and info.sha != request.revision:
            raise DownloadFailed(
                f"the hub answered commit {info.sha} for revision {request.revision} of "
                f"{request.repo_id}; refusing files of another commit"
            )
        siblings = list(info.siblings or [])
        for sibling in siblings:
            name = sibling.rfilename
            if str(name).split("/")[0] in reserved:
                raise InvalidRequest(
                    f"{request.repo_id} lists a file named {name!r}, which is the agent's own "
                    "bookkeeping name; refusing to download it"
                )
        chosen = list(
            filter_repo_objects(
                siblings, allow_patterns=request.allow_patterns, key=lambda s: s.rfilename
            )
        )
        # Only the files to fetch become paths; the repo's other files may have any name.
        for sibling in chosen:
            check_relative_name(sibling.rfilename, f"{request.repo_id} lists the file")
        entries = [
            FileEntry(
                name=s.rfilename,
                size=s.lfs.size if s.lfs is not None else s.size,
                sha256=s.lfs.sha256 if s.lfs is not None else None,
                blob_id=s.blob_id,
                lfs=s.lfs is not None,
            )
            for s in chosen
        ]
        return entries, [s.rfilename for s in siblings]

    async def fetch_file(
        self, download: Download, entry: FileEntry, path: Path, *, tick: Callable[[], None]
    ) -> None:
        """Fetch one file to ``path`` (resuming what is there) and verify it.

        ``tick`` is called as bytes arrive, for progress events. Raises DownloadFailed.
        """
        sink = await asyncio.to_thread(FileSink, path, entry)
        try:
            entry.bytes_done = await asyncio.to_thread(sink.read_prefix)
            failures = 0
            while entry.size is None or sink.offset < entry.size:
                before = sink.offset
                try:
                    if await self._transfer(download, entry, sink, tick):
                        break
                except _Transient as exc:
                    # Counted per stretch without progress, as huggingface_hub does: a
                    # long file over a flaky link may drop many times and still finish.
                    failures = 1 if sink.offset > before else failures + 1
                    if failures >= self.attempts:
                        raise DownloadFailed(
                            f"{entry.name}: {exc}; gave up after {failures} attempts, "
                            f"{sink.offset} bytes of it are kept in "
                            f"{download.folder}.partial for a resume"
                        ) from None
                    log.warning(
                        "Download %s: %s: %s; resuming from byte %d",
                        download.folder,
                        entry.name,
                        exc,
                        sink.offset,
                    )
                    await asyncio.sleep(self.retry_delay * failures)
            await asyncio.to_thread(sink.close, sync=True)
            await asyncio.to_thread(self._verify, download, entry, sink)
        finally:
            await asyncio.to_thread(sink.close, sync=False)

    async def _transfer(
        self, download: Download, entry: FileEntry, sink: FileSink, tick: Callable[[], None]
    ) -> bool:
        """One GET from ``sink.offset``; True when the file is complete.

        Raises _Transient for what a retry may cure, DownloadFailed for what it cannot.
        """
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        session = self.session()
        url = hf_hub_url(
            download.repo_id, entry.name, revision=download.revision, endpoint=self.endpoint
        )
        headers = build_hf_headers(
            token=download.token or False,
            library_name=LIBRARY_NAME,
            library_version=__version__,
        )
        # The size check and the digests are over the file's bytes, not a compressed form.
        headers["Accept-Encoding"] = "identity"
        if sink.offset:
            headers["Range"] = f"bytes={sink.offset}-"
        pending: list[bytes] = []
        pending_size = 0
        try:
            async with session.get(url, headers=headers) as resp:
                self._check_status(download, entry, resp)
                if resp.status == 416:
                    if entry.size is None:
                        return True  # the range starts at the end: the file is complete
                    raise DownloadFailed(
                        f"{entry.name}: the hub refused the range from byte {sink.offset} "
                        f"of a file of {entry.size} bytes"
                    )
                if resp.status == 200 and sink.offset:
                    log.info(
                        "Download %s: %s: the server ignored the range; starting the file over",
                        download.folder,
                        entry.name,
                    )
                    await asyncio.to_thread(sink.restart)
                    entry.bytes_done = 0
                elif resp.status == 206:
                    start = range_start(resp.headers.get("Content-Range"))
                    if start != sink.offset:
                        raise DownloadFailed(
                            f"{entry.name}: asked for bytes from {sink.offset}, the hub sent "
                            f"Content-Range {resp.headers.get('Content-Range')!r}"
                        )
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    pending.append(chunk)
                    pending_size += len(chunk)
                    entry.bytes_done = sink.offset + pending_size
                    if entry.size is not None and entry.bytes_done > entry.size:
                        raise DownloadFailed(
                            f"{entry.name}: the hub sent more than its {entry.size} bytes"
                        )
                    if pending_size >= FLUSH_BYTES:
                        await asyncio.to_thread(sink.write, b"".join(pending))
                        pending, pending_size = [], 0
                    tick()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _Transient(f"the transfer broke off ({type(exc).__name__}: {exc})") from None
        except DiskFull:
            pending = []  # what did not fit will not fit now either
            raise
        finally:
            try:
                # Bytes that arrived before a drop are good bytes: keep them for the resume.
                if pending:
                    await asyncio.to_thread(sink.write, b"".join(pending))
            finally:
                entry.bytes_done = sink.offset  # what is on disk, even when that write failed
        if entry.size is not None and sink.offset < entry.size:
            raise _Transient(f"the connection closed after byte {sink.offset} of {entry.size}")
        return True

    def _check_status(
        self, download: Download, entry: FileEntry, resp: aiohttp.ClientResponse
    ) -> None:
        status = resp.status
        if status in (200, 206, 416):
            return
        if status in (408, 429) or status >= 500:
            raise _Transient(f"the hub answered {status}")
        message = hub_refusal(status, download.repo_id, download.revision, download.token)
        raise DownloadFailed(f"{entry.name}: {message}", needs_token=status in (401, 403))

    def _verify(self, download: Download, entry: FileEntry, sink: FileSink) -> None:
        """Size and digest against the hub's metadata; a bad file is deleted."""
        actual_sha = sink.sha256.hexdigest()
        problem: str | None = None
        if entry.size is not None and sink.offset != entry.size:
            problem = f"size mismatch: expected {entry.size} bytes, got {sink.offset}"
        elif entry.lfs and entry.sha256 and actual_sha != entry.sha256:
            problem = f"SHA-256 mismatch: expected {entry.sha256}, got {actual_sha}"
        elif sink.git is not None and sink.git.hexdigest() != entry.blob_id:
            problem = f"git blob id mismatch: expected {entry.blob_id}, got {sink.git.hexdigest()}"
        if problem is not None:
            with contextlib.suppress(FileNotFoundError):
                sink.path.unlink()
            entry.bytes_done = 0
            raise DownloadFailed(
                f"{entry.name} failed verification ({problem}); it was deleted from "
                f"{download.folder}.partial, POST the download again to fetch it anew"
            )
        entry.sha256 = actual_sha
        entry.verified = True


def range_start(content_range: str | None) -> int | None:
    match = re.match(r"^bytes (\d+)-\d+/(?:\d+|\*)$", (content_range or "").strip())
    return int(match[1]) if match else None


def hub_refusal(status: int | None, repo_id: str, revision: str, token: str | None) -> str:
    """The operator's sentence for a hub refusal (the token never appears in it)."""
    if status in (401, 403):
        if token is None:
            return (
                f"the Hugging Face hub answered {status} for {repo_id}: the repo is private, "
                "gated or does not exist; POST the download again with a token that has access"
            )
        return (
            f"the Hugging Face hub answered {status} for {repo_id} with the token given: the "
            "token has no access to this repo, or the repo does not exist"
        )
    if status == 404:
        return f"the Hugging Face hub has no such repo, revision or file: {repo_id} at {revision} (404)"
    return f"the Hugging Face hub answered {status} for {repo_id} at {revision}"
