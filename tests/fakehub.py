"""A fake Hugging Face hub on 127.0.0.1, enough of it for huggingface_hub 2.4.0 and the agent.

Tests point ``HF_ENDPOINT`` (or an explicit endpoint) at :attr:`FakeHub.url`; nothing
ever talks to huggingface.co. It runs a ``ThreadingHTTPServer`` in a background
thread, so synchronous tests (tests/e2e, where the agent is another process) and
asyncio tests (tests/agent) can both use it.

What it implements, in the shapes huggingface_hub parses:

- ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}``: the model
  info, ``sha`` being the commit the revision resolves to (a branch such as ``main``
  resolves to the repo's fixed 40-hex commit; the commit itself resolves to itself).
  ``siblings`` lists every file; with ``blobs=true`` (``model_info(files_metadata=True)``)
  each sibling also has ``size``, ``blobId`` (the git object id) and, for LFS files,
  ``lfs: {sha256, size, pointerSize}``.
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``list_repo_tree``/``list_repo_files``),
  ``recursive=true`` or not, without pagination.
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: ``ETag`` (git blob id, or the LFS
  SHA-256), ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges``; for LFS files also
  ``X-Linked-Size`` and ``X-Linked-Etag``. ``Range: bytes=a-`` / ``bytes=a-b`` answers
  206 with ``Content-Range``; a range past the end answers 416. Optionally
  (``redirect_lfs``) an LFS GET answers 302 to ``/cdn/{sha256}``, as the real hub sends
  large files to its CDN.
- No xet: no ``X-Xet-*`` header and no ``xet-auth`` link is ever sent, so every client
  takes the plain HTTP path.
- Errors carry ``X-Error-Code`` like the hub's: an unknown repo, or a token-protected
  repo asked without the right ``Authorization: Bearer``, is 401 ``RepoNotFound``; an
  unknown revision 404 ``RevisionNotFound``; an unknown file 404 ``EntryNotFound``.

Test hooks, per file (:class:`HubFile`): ``drop_after`` closes the connection after
that many body bytes on the file's first GET (to test resume); ``stall_after`` sends
that many bytes on the first GET and then waits until :meth:`FakeHub.release` (to
catch a download mid-flight); ``corrupt`` serves other bytes than the metadata
describes (to test verification). Every request is recorded in :attr:`FakeHub.requests`
(method, path, query, Range header, whether Authorization was sent) — never the
header's value.

Not implemented: ``paths-info``, commits, uploads, datasets and spaces, pagination.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FakeHub", "HubFile", "HubRepo", "Recorded", "git_blob_id"]

_LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
_CREATED = "2026-01-01T00:00:00.000Z"


def git_blob_id(content: bytes) -> str:
    """The git object id of a blob with this content (what the hub calls ``blobId``)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


@dataclass
class HubFile:
    """One file of a repo, with the hooks a test may set on it."""

    name: str
    content: bytes
    lfs: bool
    drop_after: int | None = None
    stall_after: int | None = None
    corrupt: bool = False
    gets: int = 0

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def pointer(self) -> bytes:
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
            f"size {len(self.content)}\n"
        ).encode()

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.pointer if self.lfs else self.content)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id

    def served(self) -> bytes:
        """The bytes a GET sends: the content, or a same-length corruption of it."""
        if not self.corrupt:
            return self.content
        return bytes(b ^ 0xFF for b in self.content)

    def sibling(self, blobs: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"rfilename": self.name}
        if blobs:
            entry["blobId"] = self.blob_id
            entry["size"] = len(self.content)
            if self.lfs:
                entry["lfs"] = {
                    "sha256": self.sha256,
                    "size": len(self.content),
                    "pointerSize": len(self.pointer),
                }
        return entry


@dataclass
class HubRepo:
    """A model repo: one commit, its files, and an optional required token."""

    repo_id: str
    commit: str
    files: dict[str, HubFile]
    token: str | None = None
    branches: tuple[str, ...] = ("main",)

    def resolve(self, revision: str) -> str | None:
        """The commit a revision names, or None when the repo has no such revision."""
        if revision == self.commit or revision in self.branches:
            return self.commit
        return None


@dataclass(frozen=True)
class Recorded:
    """One request the hub received."""

    method: str
    path: str
    query: str
    range: str | None
    authorization: bool


@dataclass
class _State:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: threading.Event = field(default_factory=threading.Event)
    redirect_lfs: bool = False


class FakeHub:
    """The fake hub; use as a context manager or call :meth:`start` and :meth:`stop`."""

    def __init__(self, *, redirect_lfs: bool = False) -> None:
        self._state = _State(redirect_lfs=redirect_lfs)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- setup -----------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        lfs: Iterable[str] | None = None,
        token: str | None = None,
        commit: str | None = None,
    ) -> HubRepo:
        """Add a repo; ``lfs`` names the LFS files (default: .gguf, .safetensors, .bin)."""
        lfs_names = set(lfs) if lfs is not None else {n for n in files if n.endswith(_LFS_SUFFIXES)}
        digest = hashlib.sha1(repo_id.encode(), usedforsecurity=False).hexdigest()
        repo = HubRepo(
            repo_id=repo_id,
            commit=commit or digest,
            files={n: HubFile(name=n, content=c, lfs=n in lfs_names) for n, c in files.items()},
            token=token,
        )
        with self._state.lock:
            self._state.repos[repo_id] = repo
        return repo

    def file(self, repo_id: str, name: str) -> HubFile:
        """A file of a repo, to set hooks on it."""
        return self._state.repos[repo_id].files[name]

    @property
    def requests(self) -> list[Recorded]:
        with self._state.lock:
            return list(self._state.requests)

    def gets(self, name: str) -> list[Recorded]:
        """The GETs of files whose path ends with ``/name``."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + name)]

    def release(self) -> None:
        """Let every stalled response go on (and any later one not stall)."""
        self._state.released.set()

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None, "the fake hub is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        state = self._state

        class Handler(_Handler):
            hub_state = state

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        # A short poll interval: stop() waits for one, and tests stop a hub each.
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="fakehub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._state.released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_API = re.compile(
    r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/(?P<rest>revision|tree)/(?P<tail>.+))?$"
)
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_CDN = re.compile(r"^/cdn/(?P<sha>[0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub_state: _State

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests read :attr:`FakeHub.requests` instead

    # -- plumbing --------------------------------------------------------------------

    def _record(self) -> tuple[str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        with self.hub_state.lock:
            self.hub_state.requests.append(
                Recorded(
                    method=self.command,
                    path=path,
                    query=parts.query,
                    range=self.headers.get("Range"),
                    authorization=self.headers.get("Authorization") is not None,
                )
            )
        return path, parse_qs(parts.query)

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        self._send(
            status,
            json.dumps(data).encode(),
            {"Content-Type": "application/json", **(headers or {})},
        )

    def _error(self, status: int, code: str, message: str) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, repo_id: str) -> HubRepo | None:
        """The repo if it exists and the request may see it; answers the error otherwise."""
        with self.hub_state.lock:
            repo = self.hub_state.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return None
        return repo

    # -- verbs -----------------------------------------------------------------------

    def do_GET(self) -> None:
        path, query = self._record()
        if match := _API.match(path):
            return self._api(match, query)
        if match := _RESOLVE.match(path):
            return self._resolve(match)
        if match := _CDN.match(path):
            return self._cdn(match["sha"])
        return self._error(404, "EntryNotFound", f"no route for {path}")

    def do_HEAD(self) -> None:
        path, _query = self._record()
        if match := _RESOLVE.match(path):
            return self._resolve(match)
        if match := _CDN.match(path):
            return self._cdn(match["sha"])
        return self._error(404, "EntryNotFound", f"no route for {path}")

    # -- API -------------------------------------------------------------------------

    def _api(self, match: re.Match[str], query: dict[str, list[str]]) -> None:
        repo = self._repo(match["repo"])
        if repo is None:
            return
        rest, tail = match["rest"], match["tail"] or ""
        revision, _, sub = tail.partition("/") if rest == "tree" else (tail, "", "")
        commit = repo.resolve(revision or "main")
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if rest == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            return self._json(200, _tree(repo, sub, recursive))
        blobs = query.get("blobs", ["false"])[0].lower() in ("true", "1")
        author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        self._json(
            200,
            {
                "_id": commit[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": author,
                "sha": commit,
                "lastModified": _CREATED,
                "createdAt": _CREATED,
                "private": repo.token is not None,
                "gated": False,
                "disabled": False,
                "tags": ["gguf"],
                "library_name": "gguf",
                "siblings": [f.sibling(blobs) for f in repo.files.values()],
                "usedStorage": sum(len(f.content) for f in repo.files.values()),
            },
        )

    # -- files -----------------------------------------------------------------------

    def _resolve(self, match: re.Match[str]) -> None:
        repo = self._repo(match["repo"])
        if repo is None:
            return
        commit = repo.resolve(match["rev"])
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {match['rev']}")
        hub_file = repo.files.get(match["file"])
        if hub_file is None:
            return self._error(404, "EntryNotFound", f"{match['file']} does not exist")
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{hub_file.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if hub_file.lfs:
            headers["X-Linked-Size"] = str(len(hub_file.content))
            headers["X-Linked-Etag"] = f'"{hub_file.sha256}"'
            if self.hub_state.redirect_lfs and self.command == "GET":
                headers["Location"] = f"/cdn/{hub_file.sha256}"
                return self._send(302, b"", headers)
        self._serve_bytes(hub_file, headers)

    def _cdn(self, sha: str) -> None:
        with self.hub_state.lock:
            found = [
                f
                for r in self.hub_state.repos.values()
                for f in r.files.values()
                if f.sha256 == sha
            ]
        if not found:
            return self._error(404, "EntryNotFound", "no such object")
        self._serve_bytes(found[0], {"Accept-Ranges": "bytes", "ETag": f'"{sha}"'})

    def _serve_bytes(self, hub_file: HubFile, headers: dict[str, str]) -> None:
        body = hub_file.served()
        total = len(body)
        start, end, status = 0, total - 1, 200
        wanted = self.headers.get("Range")
        if wanted:
            match = _RANGE.match(wanted.strip())
            if match is None:
                return self._error(400, "BadRequest", f"unsupported Range {wanted}")
            start = int(match[1])
            end = min(int(match[2]), total - 1) if match[2] else total - 1
            if start >= total:
                headers["Content-Range"] = f"bytes */{total}"
                return self._send(416, b"", headers)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        chunk = body[start : end + 1]
        if self.command == "HEAD":
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(chunk)))
            self.end_headers()
            return
        with self.hub_state.lock:
            hub_file.gets += 1
            first = hub_file.gets == 1
        cut = hub_file.drop_after if first else None
        stall = hub_file.stall_after if first else None
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        if cut is not None and cut < len(chunk):
            self.wfile.write(chunk[:cut])
            self.wfile.flush()
            self._hang_up()
            return
        if stall is not None and stall < len(chunk):
            self.wfile.write(chunk[:stall])
            self.wfile.flush()
            self.hub_state.released.wait(timeout=30)
            self._hang_up()
            return
        self.wfile.write(chunk)

    def _hang_up(self) -> None:
        """Close the connection abruptly, as a network drop would."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _tree(repo: HubRepo, sub: str, recursive: bool) -> list[dict[str, Any]]:
    prefix = sub.strip("/") + "/" if sub.strip("/") else ""
    entries: dict[str, dict[str, Any]] = {}
    for hub_file in repo.files.values():
        if not hub_file.name.startswith(prefix):
            continue
        rest = hub_file.name[len(prefix) :]
        if "/" in rest and not recursive:
            directory = prefix + rest.split("/")[0]
            entries[directory] = {
                "type": "directory",
                "oid": "0" * 40,
                "size": 0,
                "path": directory,
            }
            continue
        if recursive:
            parts = rest.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                directory = prefix + "/".join(parts[:depth])
                entries[directory] = {
                    "type": "directory",
                    "oid": "0" * 40,
                    "size": 0,
                    "path": directory,
                }
        entry: dict[str, Any] = {
            "type": "file",
            "oid": hub_file.blob_id,
            "size": len(hub_file.content),
            "path": hub_file.name,
        }
        if hub_file.lfs:
            entry["lfs"] = {
                "oid": hub_file.sha256,
                "size": len(hub_file.content),
                "pointerSize": len(hub_file.pointer),
            }
        entries[hub_file.name] = entry
    return list(entries.values())
