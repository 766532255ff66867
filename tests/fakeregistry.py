"""A container registry on 127.0.0.1 for the pull tests: the part of the OCI
distribution API (Docker Registry HTTP API v2) that a pull uses, over plain HTTP.

There is no registry this machine can reach, so the tests export an image from
Podman's local store (:func:`export_oci_dir`) and serve its manifest, config and
layers from here byte for byte: the digests Podman checks are those of the files.
Like tests/fakehub.py it runs a ``ThreadingHTTPServer`` on a daemon thread, so
synchronous and asyncio tests can both use it.

What it answers:

- ``GET /v2/``: 200 ``{}`` with ``Docker-Distribution-API-Version: registry/2.0``
  (how a client learns it speaks v2; no authentication is asked).
- ``GET|HEAD /v2/<name>/manifests/<tag or digest>``: the manifest with its own media
  type as ``Content-Type``, ``Docker-Content-Digest`` and ``Content-Length``. A request
  whose ``Accept`` names types but neither that one nor a wildcard is answered 404
  ``MANIFEST_UNKNOWN``, as a registry holding no manifest of an acceptable type does.
- ``GET|HEAD /v2/<name>/blobs/<digest>``: a config or layer blob, with
  ``Content-Length`` and ``Docker-Content-Digest``. No ``Range`` support: a client
  that resumes gets the whole blob again, or fails.
- Anything else: 404 with the registry's error body (``{"errors": [{"code": ...}]}``).

Test hooks, per blob (:class:`BlobHooks`): ``delay_after`` bytes sent, then a pause of
``delay_seconds`` (so a pull is caught mid-layer and reports progress); ``cut_after``
bytes sent, then the connection is closed (on every GET: a registry that always breaks,
so retries do not hide it). Every request is recorded (:attr:`FakeRegistry.requests`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["BlobHooks", "FakeRegistry", "OciImage", "Recorded", "export_oci_dir"]

_NAME = r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
_MANIFEST = re.compile(rf"^/v2/(?P<name>{_NAME})/manifests/(?P<ref>[A-Za-z0-9_.:-]+)$")
_BLOB = re.compile(rf"^/v2/(?P<name>{_NAME})/blobs/(?P<digest>sha256:[0-9a-f]{{64}})$")
_CHUNK = 64 * 1024


def export_oci_dir(image: str, folder: Path, env: dict[str, str]) -> Path:
    """``image`` of Podman's store saved as an OCI layout in ``folder`` (compressed layers,
    as a registry holds them)."""
    podman = shutil.which("podman")
    if podman is None:
        raise AssertionError("podman is not installed: 'apt-get install podman runc'")
    subprocess.run(
        [podman, "save", "--format", "oci-dir", "-o", str(folder), image],
        env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return folder


def _digest(content: bytes) -> str:
    return "sha256:" + hashlib.sha256(content).hexdigest()


@dataclass(frozen=True)
class OciImage:
    """One image: its manifest (bytes and media type) and every blob it names."""

    manifest: bytes
    media_type: str
    blobs: dict[str, bytes]

    @property
    def digest(self) -> str:
        """The manifest's digest: what ``name@sha256:...`` pins."""
        return _digest(self.manifest)

    @property
    def config_digest(self) -> str:
        return str(json.loads(self.manifest)["config"]["digest"])

    @property
    def layer_digests(self) -> list[str]:
        return [str(layer["digest"]) for layer in json.loads(self.manifest)["layers"]]

    @classmethod
    def from_oci_dir(cls, folder: Path) -> OciImage:
        """The single image of an OCI layout (``podman save --format oci-dir``)."""
        index = json.loads((folder / "index.json").read_text())
        [entry] = index["manifests"]

        def blob(digest: str) -> bytes:
            algorithm, _, hexdigest = digest.partition(":")
            content = (folder / "blobs" / algorithm / hexdigest).read_bytes()
            assert _digest(content) == digest, f"{digest} in {folder} does not match its bytes"
            return content

        manifest = blob(entry["digest"])
        parsed = json.loads(manifest)
        named = [parsed["config"], *parsed["layers"]]
        return cls(
            manifest=manifest,
            media_type=parsed.get("mediaType") or entry["mediaType"],
            blobs={d["digest"]: blob(d["digest"]) for d in named},
        )


@dataclass
class BlobHooks:
    """What to do to a blob's body (see the module's docstring)."""

    delay_after: int | None = None
    delay_seconds: float = 0.0
    cut_after: int | None = None


@dataclass(frozen=True)
class Recorded:
    """One request the registry received (``kind``: base, manifest, blob or other)."""

    method: str
    path: str
    kind: str
    accept: str | None
    status: int


@dataclass
class _Repository:
    tags: dict[str, str] = field(default_factory=dict)
    manifests: dict[str, OciImage] = field(default_factory=dict)


@dataclass
class _State:
    repositories: dict[str, _Repository] = field(default_factory=dict)
    hooks: dict[str, BlobHooks] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeRegistry:
    """The registry; use as a context manager or call :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self._state = _State()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- setup -----------------------------------------------------------------------

    def push(self, name: str, tag: str, image: OciImage) -> OciImage:
        """Serve ``image`` as ``name:tag`` and ``name@<its digest>``."""
        with self._state.lock:
            repo = self._state.repositories.setdefault(name, _Repository())
            repo.tags[tag] = image.digest
            repo.manifests[image.digest] = image
        return image

    def hook(self, digest: str, hooks: BlobHooks) -> None:
        """Set (or with ``BlobHooks()`` clear) the hooks of one blob."""
        with self._state.lock:
            self._state.hooks[digest] = hooks

    def reset(self) -> None:
        """Forget the recorded requests and every hook (between tests)."""
        with self._state.lock:
            self._state.requests.clear()
            self._state.hooks.clear()

    @property
    def requests(self) -> list[Recorded]:
        with self._state.lock:
            return list(self._state.requests)

    def served(self, kind: str, method: str = "GET") -> list[str]:
        """The paths of the requests of one kind answered 200."""
        return [
            r.path
            for r in self.requests
            if r.kind == kind and r.method == method and r.status == 200
        ]

    # -- lifecycle -------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._server is not None, "the registry is not started"
        return int(self._server.server_address[1])

    @property
    def location(self) -> str:
        """How image references name it (``localhost:PORT``, a registry host a client
        does not take for a Docker Hub namespace)."""
        return f"localhost:{self.port}"

    def start(self) -> FakeRegistry:
        state = self._state

        class Handler(_Handler):
            registry_state = state

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.02},
            name="fakeregistry",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    registry_state: _State

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests read FakeRegistry.requests instead

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path in ("/v2", "/v2/"):
            return self._answer("base", 200, b"{}", {"Content-Type": "application/json"})
        if match := _MANIFEST.match(path):
            return self._manifest(match["name"], match["ref"])
        if match := _BLOB.match(path):
            return self._blob(match["name"], match["digest"])
        return self._error("other", 404, "NAME_UNKNOWN", f"no route for {path}")

    def _record(self, kind: str, status: int) -> None:
        accept = ", ".join(self.headers.get_all("Accept") or []) or None
        path = unquote(urlsplit(self.path).path)
        with self.registry_state.lock:
            self.registry_state.requests.append(Recorded(self.command, path, kind, accept, status))

    def _answer(self, kind: str, status: int, body: bytes, headers: dict[str, str]) -> None:
        self._record(kind, status)
        self.send_response(status)
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, kind: str, status: int, code: str, message: str) -> None:
        body = json.dumps({"errors": [{"code": code, "message": message, "detail": None}]})
        self._answer(kind, status, body.encode(), {"Content-Type": "application/json"})

    def _repository(self, name: str) -> _Repository | None:
        with self.registry_state.lock:
            return self.registry_state.repositories.get(name)

    def _manifest(self, name: str, reference: str) -> None:
        repo = self._repository(name)
        if repo is None:
            return self._error("manifest", 404, "NAME_UNKNOWN", f"repository {name} not known")
        digest = reference if reference.startswith("sha256:") else repo.tags.get(reference)
        image = repo.manifests.get(digest or "")
        if image is None:
            return self._error("manifest", 404, "MANIFEST_UNKNOWN", f"{reference} not known")
        if not _acceptable(self.headers.get_all("Accept") or [], image.media_type):
            return self._error(
                "manifest", 404, "MANIFEST_UNKNOWN", f"no manifest of {name} in an accepted type"
            )
        headers = {"Content-Type": image.media_type, "Docker-Content-Digest": image.digest}
        self._answer("manifest", 200, image.manifest, headers)

    def _blob(self, name: str, digest: str) -> None:
        repo = self._repository(name)
        content = None
        if repo is not None:
            content = next(
                (i.blobs[digest] for i in repo.manifests.values() if digest in i.blobs), None
            )
        if content is None:
            return self._error("blob", 404, "BLOB_UNKNOWN", f"blob {digest} not known")
        with self.registry_state.lock:
            hooks = self.registry_state.hooks.get(digest, BlobHooks())
        self._record("blob", 200)
        self.send_response(200)
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Docker-Content-Digest", digest)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if self.command == "HEAD":
            return
        sent = 0
        while sent < len(content):
            if hooks.cut_after is not None and sent >= hooks.cut_after:
                return self._hang_up()
            if hooks.delay_after is not None and sent >= hooks.delay_after:
                self.wfile.flush()
                time.sleep(hooks.delay_seconds)
                hooks = BlobHooks(cut_after=hooks.cut_after)
            end = len(content)
            for limit in (hooks.cut_after, hooks.delay_after):
                if limit is not None and sent < limit:
                    end = min(end, limit)
            end = min(end, sent + _CHUNK)
            self.wfile.write(content[sent:end])
            sent = end

    def _hang_up(self) -> None:
        """Close the connection mid-body, as a network drop would."""
        self.wfile.flush()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _acceptable(accept: list[str], media_type: str) -> bool:
    """Whether an ``Accept`` (every header of that name) lets ``media_type`` through."""
    types = {part.split(";")[0].strip() for value in accept for part in value.split(",")}
    types.discard("")
    return not types or bool(types & {media_type, "*/*", "application/*"})
