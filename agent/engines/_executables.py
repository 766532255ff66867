"""The catalogue of launchable executables and their manifest verification.

Only executables named in the config can be launched, and only when every file of the
version folder matches the ``manifest.json`` that lies next to it::

    {"name": "llama.cpp", "version": "0.6.0-dev",
     "files": {"llama-server": {"sha256": "<hex>", "size": 123}, "libllama.so.0.6.0": {...}},
     "links": {"libllama.so.0": "libllama.so.0.6.0"}}

Every file is hashed at agent start. A changed file, a missing one, a wrong link, or an
executable or shared library that the manifest does not list (something dropped in to
be loaded through the binary's ``$ORIGIN`` RUNPATH) makes the entry unverified: it is
reported as health reason ``executable_unverified`` and launches naming it are refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._config import ExecutableEntry
from agent._errors import ExecutableUnverified, SpecRejected
from protocol.atomic import write_atomic

__all__ = [
    "MANIFEST_NAME",
    "Catalogue",
    "ExecutableInfo",
    "build_manifest",
    "sha256_file",
    "verify_folder",
    "write_manifest",
]

log = logging.getLogger("mirbad.agent.executables")

MANIFEST_NAME = "manifest.json"
_LIBRARY_RE = re.compile(r"\.(so(\.[0-9.]+)?|dylib|dll)$")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(folder: Path, *, name: str, version: str) -> dict[str, Any]:
    """Describe every regular file and symlink below ``folder`` (manifest.json excluded)."""
    files: dict[str, dict[str, Any]] = {}
    links: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST_NAME:
            continue
        if path.is_symlink():
            links[rel] = os.readlink(path)
        elif path.is_file():
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return {"name": name, "version": version, "files": files, "links": links}


def write_manifest(folder: Path, *, name: str, version: str) -> dict[str, Any]:
    """Build and atomically write ``folder/manifest.json``; returns the manifest."""
    manifest = build_manifest(folder, name=name, version=version)
    write_atomic(
        folder / MANIFEST_NAME, json.dumps(manifest, indent=2).encode() + b"\n", mode=0o644
    )
    return manifest


def _looks_loadable(path: Path, mode: int) -> bool:
    return bool(mode & 0o111) or bool(_LIBRARY_RE.search(path.name))


def verify_folder(folder: Path, *, name: str, version: str, binary: str) -> str | None:
    """None when the folder matches its manifest, else a sentence naming the first problem."""
    manifest_path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{manifest_path} does not exist"
    except (OSError, ValueError) as exc:
        return f"{manifest_path} cannot be read: {exc}"
    if not isinstance(manifest, dict):
        return f"{manifest_path} is not a JSON object"
    if manifest.get("name") != name or manifest.get("version") != version:
        return (
            f"{manifest_path} describes {manifest.get('name')!r} {manifest.get('version')!r}, "
            f"but the config names {name!r} {version!r}"
        )
    files = manifest.get("files")
    links = manifest.get("links", {})
    if not isinstance(files, dict) or not isinstance(links, dict):
        return f"{manifest_path} has no 'files' object"
    if binary not in files:
        return f"{manifest_path} does not list {binary}"
    root = folder.resolve()
    for rel, expected in sorted(files.items()):
        path = folder / rel
        if not isinstance(expected, dict) or path.is_symlink() or not path.is_file():
            return f"{rel} is missing or not a regular file"
        if not path.resolve().is_relative_to(root):
            return f"{rel} lies outside the version folder"
        size = path.stat().st_size
        if size != expected.get("size"):
            return f"{rel} has size {size}, the manifest says {expected.get('size')}"
        if sha256_file(path) != expected.get("sha256"):
            return f"{rel} does not match its SHA-256 in the manifest"
    for rel, target in sorted(links.items()):
        path = folder / rel
        if not path.is_symlink():
            return f"link {rel} is missing"
        if os.readlink(path) != target:
            return f"link {rel} points to {os.readlink(path)}, the manifest says {target}"
        if not path.resolve().is_relative_to(root):
            return f"link {rel} points outside the version folder"
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST_NAME or rel in files or rel in links:
            continue
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            continue
        if stat.S_ISLNK(mode) or _looks_loadable(path, mode):
            return f"{rel} is not listed in the manifest"
    return None


@dataclass(frozen=True, kw_only=True)
class ExecutableInfo:
    """A configured executable and the outcome of its verification."""

    name: str
    version: str
    path: Path
    default: bool
    verified: bool
    problem: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "default": self.default,
            "verified": self.verified,
        }


class Catalogue:
    """The executables of the config, verified once at start."""

    def __init__(self, *, entries: tuple[ExecutableEntry, ...]) -> None:
        self._entries = entries
        self._infos: list[ExecutableInfo] = []

    def verify(self) -> list[ExecutableInfo]:
        """Hash every file of every entry (blocking; call it in a thread at start)."""
        infos: list[ExecutableInfo] = []
        for entry in self._entries:
            only_one = sum(1 for e in self._entries if e.name == entry.name) == 1
            problem: str | None
            if not entry.path.is_file():
                problem = f"{entry.path} does not exist"
            else:
                problem = verify_folder(
                    entry.path.parent,
                    name=entry.name,
                    version=entry.version,
                    binary=entry.path.name,
                )
            if problem:
                log.error("Executable %s %s is unverified: %s", entry.name, entry.version, problem)
            else:
                log.info("Executable %s %s verified (%s)", entry.name, entry.version, entry.path)
            infos.append(
                ExecutableInfo(
                    name=entry.name,
                    version=entry.version,
                    path=entry.path,
                    default=entry.default or only_one,
                    verified=problem is None,
                    problem=problem,
                )
            )
        self._infos = infos
        return infos

    @property
    def infos(self) -> list[ExecutableInfo]:
        return list(self._infos)

    def health_reasons(self) -> list[dict[str, str]]:
        return [
            {
                "code": "executable_unverified",
                "message": f"Executable {i.name} {i.version} does not match its manifest: {i.problem}.",
            }
            for i in self._infos
            if not i.verified
        ]

    def resolve(self, name: str, version: str | None) -> ExecutableInfo:
        """The entry to launch; the default one of ``name`` when ``version`` is None."""
        same = [i for i in self._infos if i.name == name]
        if not same:
            known = sorted({i.name for i in self._infos})
            raise SpecRejected(
                f"executable {name!r} is not configured on this node"
                + (
                    f" (configured: {', '.join(known)})"
                    if known
                    else " (no executables are configured)"
                )
            )
        if version is None:
            chosen = next((i for i in same if i.default), None)
            if chosen is None:
                raise SpecRejected(
                    f"executable {name!r} has no default version on this node; name one"
                )
        else:
            chosen = next((i for i in same if i.version == version), None)
            if chosen is None:
                versions = ", ".join(sorted(i.version for i in same))
                raise SpecRejected(
                    f"{name} version {version!r} is not configured on this node (configured: {versions})"
                )
        if not chosen.verified:
            raise ExecutableUnverified(
                f"{chosen.name} {chosen.version} does not match its manifest: {chosen.problem}"
            )
        return chosen
