"""What the models root holds, and taking back only what this system fetched.

The inventory lists every folder under the models root with its files and sizes, and
says which are *fetched*: a folder is fetched when its ``.mirbad-fetched.json``
manifest (written by :mod:`agent.weights._downloads` at finalize) exists and the folder holds
exactly the files it lists, at the sizes it lists. A file the operator added makes the
folder not wholly ours; that file is reported ``"fetched": false``.

Reclaiming is the dangerous half, so it is built around what it will not do. The
master asks; the agent decides, re-checking everything on its own disk: the folder
name, that the folder resolves inside the models root, that the manifest is there,
and for every path it lists that it is a plain relative name, a regular file (not a
symlink) inside the folder, at the size the manifest recorded. Only such files are
deleted. Anything else (an operator's file, a folder without a manifest, a file that
changed size since it was fetched) is left where it is and reported as kept. A master
that is wrong, newer than the agent, or tampered with cannot talk the node into
deleting a model somebody copied by hand.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._errors import ApiError, FolderInUse, InvalidRequest, NotFetched, NotFound
from agent.engines import check_folder_name, check_relative_name, confined_path
from agent.weights._downloads import MANIFEST_NAME, PARTIAL_SUFFIX

__all__ = ["ReclaimPlan", "Weights", "describe_folder", "read_manifest"]

log = logging.getLogger("mirbad.agent.weights")

_SCAN_TTL = 10.0


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest if it is a regular file holding a valid one, else None."""
    path = folder / MANIFEST_NAME
    try:
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        return None
    files = data["files"]
    if not all(
        isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("size"), int)
        for f in files
    ):
        return None
    return data


@dataclass(frozen=True, kw_only=True)
class ReclaimPlan:
    """A reclaim that passed its checks: the folder and the manifest's files."""

    folder: str
    path: Path
    files: list[tuple[str, int]]


@dataclass(frozen=True, kw_only=True)
class _Found:
    name: str
    size: int
    regular: bool


def _walk(folder: Path, root: Path | None = None) -> list[_Found]:
    """Every file under ``folder`` (relative names, ``/``-separated), never following links.

    A link's size is its target's when the target lies inside ``root`` (the models
    root, resolved), else 0: the inventory says nothing of a file outside the root.
    """
    found: list[_Found] = []
    for directory, dirnames, filenames in os.walk(folder, followlinks=False):
        base = Path(directory)
        names = list(filenames)
        # A symlink to a directory is listed among dirnames by os.walk; report it as an
        # entry of its own (never entered), since it is not a file this system wrote.
        names += [d for d in dirnames if (base / d).is_symlink()]
        dirnames[:] = [d for d in dirnames if not (base / d).is_symlink()]
        for name in names:
            path = base / name
            relative = path.relative_to(folder).as_posix()
            if relative == MANIFEST_NAME:
                continue
            try:
                info = path.lstat()
            except OSError:
                continue
            regular = stat.S_ISREG(info.st_mode)
            size = info.st_size
            if not regular:
                try:
                    target = path.resolve(strict=True)
                    inside = root is not None and target.is_relative_to(root)
                    size = path.stat().st_size if inside else 0
                except (OSError, RuntimeError):
                    size = 0
            found.append(_Found(name=relative, size=size, regular=regular))
    found.sort(key=lambda f: f.name)
    return found


def describe_folder(root: Path, folder: str) -> dict[str, Any]:
    """One folder of the inventory (see the module docstring for ``fetched``)."""
    path = root / folder
    files = _walk(path, root.resolve())
    manifest = read_manifest(path)
    listed: dict[str, int] = {}
    if manifest is not None:
        listed = {f["name"]: f["size"] for f in manifest["files"]}
    entries = [
        {"name": f.name, "bytes": f.size, "fetched": f.regular and listed.get(f.name) == f.size}
        for f in files
    ]
    present = {e["name"] for e in entries if e["fetched"]}
    fetched = manifest is not None and all(e["fetched"] for e in entries) and present == set(listed)
    source = None
    if manifest is not None and isinstance(manifest.get("source"), dict):
        src = manifest["source"]
        source = {"repoId": src.get("repoId"), "revision": src.get("revision")}
    return {
        "folder": folder,
        "bytes": sum(f.size for f in files),
        "files": entries,
        "fetched": fetched,
        "source": source,
    }


class Weights:
    """The models root's inventory (cached for the heartbeat) and reclaim."""

    def __init__(
        self,
        *,
        models_root: Path,
        in_use: Callable[[str], bool] = lambda folder: False,
        ttl: float = _SCAN_TTL,
    ) -> None:
        self.models_root = models_root
        self._in_use = in_use
        self._ttl = ttl
        self._cached: list[dict[str, Any]] | None = None
        self._cached_at = 0.0

    def scan(self) -> list[dict[str, Any]]:
        """Every folder under the models root, read now (``*.partial`` are downloads)."""
        root = self.models_root
        folders: list[dict[str, Any]] = []
        try:
            children = sorted(root.iterdir(), key=lambda p: p.name)
        except OSError as exc:
            log.warning("Cannot list the models root %s: %s", root, exc)
            children = []
        for child in children:
            if child.name.endswith(PARTIAL_SUFFIX) or not child.is_dir():
                continue
            try:
                confined_path(root, child.name)
            except ApiError as exc:
                # A folder linked out of the root is not listed (no launch may use it).
                log.warning("Not listing model folder %s: %s", child.name, exc.message)
                continue
            try:
                folders.append(describe_folder(root, child.name))
            except OSError as exc:
                log.warning("Cannot read model folder %s: %s", child, exc)
        self._cached = folders
        self._cached_at = time.monotonic()
        return folders

    def inventory(self) -> dict[str, Any]:
        """GET /model-folders: a fresh scan."""
        return {"modelsRoot": str(self.models_root), "folders": self.scan()}

    def summary(self) -> list[dict[str, Any]]:
        """For the heartbeat: folder, bytes, fetched; rescanned at most every ``ttl`` s."""
        if self._cached is None or time.monotonic() - self._cached_at >= self._ttl:
            self.scan()
        assert self._cached is not None
        return [
            {"folder": f["folder"], "bytes": f["bytes"], "fetched": f["fetched"]}
            for f in self._cached
        ]

    def invalidate(self) -> None:
        """Forget the cached scan (a download finished, a folder was reclaimed)."""
        self._cached = None

    def reclaim(self, folder: str) -> dict[str, Any]:
        """DELETE /model-folders/{folder}: delete only the manifest's files (see above)."""
        return self.carry_out(self.check_reclaim(folder))

    def check_reclaim(self, folder: str) -> ReclaimPlan:
        """The refusals of a reclaim: 400, 404, 409 ``not_fetched`` or ``folder_in_use``."""
        check_folder_name(folder)
        path = self.models_root / folder
        if not os.path.lexists(path):
            raise NotFound(f"model folder {folder!r} does not exist on this node")
        if path.is_symlink():
            raise InvalidRequest(
                f"model folder {folder!r} is a symbolic link; the agent reclaims only real "
                "folders inside the models root"
            )
        real = confined_path(self.models_root, folder)
        if not real.is_dir():
            raise InvalidRequest(f"{folder!r} in the models root is not a folder")
        manifest = read_manifest(real)
        if manifest is None:
            raise NotFetched(
                f"model folder {folder!r} was not fetched by MirbadLLM (it has no valid "
                f"{MANIFEST_NAME}); it is left alone; remove it by hand if you mean to"
            )
        if self._in_use(folder):
            raise FolderInUse(
                f"model folder {folder!r} is used by a running instance; stop it first"
            )
        files = [(str(f["name"]), int(f["size"])) for f in manifest["files"]]
        return ReclaimPlan(folder=folder, path=real, files=files)

    def carry_out(self, plan: ReclaimPlan) -> dict[str, Any]:
        """Delete what :meth:`check_reclaim` allowed, each file checked again first."""
        real = plan.path
        removed: list[str] = []
        refused: list[str] = []
        freed = 0
        for name, size in plan.files:
            target = self._listed_file(real, name, size)
            if target is None:
                if os.path.lexists(real / name):
                    refused.append(name)
                continue
            target.unlink()
            removed.append(name)
            freed += size
            self._prune_dirs(real, target.parent)
        if not refused:
            (real / MANIFEST_NAME).unlink(missing_ok=True)
        kept = [f.name for f in _walk(real)]
        with contextlib.suppress(OSError):
            real.rmdir()  # fails while it holds anything: the operator's files stay
        self.invalidate()
        log.info(
            "Reclaimed %s: removed %d file(s), %d bytes; kept %d",
            plan.folder,
            len(removed),
            freed,
            len(kept),
        )
        return {"folder": plan.folder, "removed": removed, "kept": kept, "bytesFreed": freed}

    @staticmethod
    def _listed_file(folder: Path, name: Any, size: int) -> Path | None:
        """The path of a manifest entry if it is safe to delete, else None (it stays)."""
        try:
            relative = check_relative_name(name, "manifest")
            target = folder.joinpath(relative)
            info = target.lstat()
        except (ApiError, OSError):
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return None
        # Every directory on the way must be a real one inside the folder: the
        # resolved parent is the folder joined with the name's own parent parts.
        if target.parent.resolve() != folder.joinpath(relative.parent):
            return None
        return target

    @staticmethod
    def _prune_dirs(folder: Path, directory: Path) -> None:
        """Remove directories a fetched file lived in once they are empty."""
        while directory != folder and folder in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent
