"""Hostile folder and file names, and a hostile models root, for both sides' path tests.

The corpus is data: every name in :data:`HOSTILE_NAMES` must be refused by the one name
rule (protocol.names) on every platform, and :func:`build_hostile_root` lays out real
symbolic links that lead out of a models root. :class:`Snapshot` proves that nothing
outside the root was created, changed or deleted; :data:`SENTINEL` is a file name no
request names, so finding it in an answer means a directory outside the root was listed.
Used by tests/agent/test_paths_hostile.py (the agent over HTTP) and
tests/models_registry/test_paths_hostile.py (the master's API and console).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

# (label, name). The label says which trap the name sets.
HOSTILE: tuple[tuple[str, str], ...] = (
    # Dots and separators.
    ("parent", ".."),
    ("self", "."),
    ("three dots", "..."),
    ("parent slash", "../x"),
    ("parent file", "../../etc/passwd"),
    ("inner parent", "a/../../b"),
    ("trailing parent", "x/.."),
    ("dot slash", "./x"),
    ("empty", ""),
    ("absolute", "/etc/passwd"),
    ("root", "/"),
    ("double slash", "//etc"),
    ("sibling prefix", "../models2/victim"),
    # Windows: drives, UNC and device paths, backslashes, alternate data streams.
    ("drive", "C:"),
    ("drive relative", "c:x"),
    ("drive path", "C:\\Windows\\win.ini"),
    ("drive slash", "C:/Windows"),
    ("unc", "\\\\server\\share"),
    ("unc device", "\\\\?\\C:\\x"),
    ("pipe", "\\\\.\\pipe\\x"),
    ("backslash parent", "..\\..\\x"),
    ("backslash", "a\\b"),
    ("stream", "x:stream"),
    ("data stream", "x.gguf:$DATA"),
    ("default stream", "x.gguf::$DATA"),
    # Windows device names, with and without an extension, in any case.
    ("con", "CON"),
    ("con lower", "con"),
    ("prn", "PRN"),
    ("aux", "AUX"),
    ("nul", "NUL"),
    ("nul ext", "nul.gguf"),
    ("com1", "COM1"),
    ("com9 ext", "com9.txt"),
    ("com0", "COM0"),
    ("lpt1", "LPT1"),
    ("lpt9 ext", "lpt9.gguf"),
    ("lpt0", "lpt0"),
    ("con double ext", "CON.tar.gz"),
    # Names Windows trims to another name.
    ("trailing dot", "model."),
    ("trailing dots", "model.."),
    ("trailing space", "model "),
    ("leading space", " model"),
    ("dot space", "model. "),
    # NUL and control characters.
    ("nul byte", "model\x00"),
    ("only nul", "\x00"),
    ("nul parent", "a\x00/../../etc"),
    ("newline", "model\n"),
    ("crlf", "model\r\n"),
    ("tab", "\t"),
    # Very long names and paths.
    ("long name", "a" * 256),
    ("very long name", "b" * 5000),
    ("deep path", "a/" * 600 + "x"),
    # Look-alikes and encodings a layer might decode.
    ("fullwidth dots", "\uff0e\uff0e"),
    ("dot leader", "\u2025"),
    ("percent dots", "%2e%2e"),
    ("percent slash", "..%2f.."),
    ("zero width", "model\u200b"),
    ("accent", "mod\u00e8le"),
    ("tilde", "~"),
    ("home", "$HOME"),
    ("windows env", "%APPDATA%"),
)
HOSTILE_NAMES: tuple[str, ...] = tuple(name for _, name in HOSTILE)

# A file name no request ever names: found in an answer, a directory outside was listed.
SENTINEL = "listing-sentinel-4f1c.gguf"

# Folders of the hostile root whose names pass the name rule but that lead out of it.
LINKED_OUT = ("link-out", "link-rel", "link-sibling", "trap", "chain-a", "loop-a")
# (folder, file) pairs whose file leads out of the root, and the folder that stays in.
FILES_OUT = (
    ("mixed", "mixed.gguf"),
    ("trap", "victim.gguf"),
    ("link-out", "secret.gguf"),
    ("chain-a", "secret.gguf"),
    ("link-sibling", "victim"),
)
LINKED_IN = "chain-in"
FETCHED = "fetched"
FETCHED_MANIFEST_NAMES = (
    "own.gguf",
    "../../outside/secret.gguf",
    "sub/secret.gguf",
    "..\\..\\outside\\secret.gguf",
    "C:secret.gguf",
)


@dataclass(frozen=True)
class HostileRoot:
    """Where :func:`build_hostile_root` put things; ``root`` is the models root."""

    root: Path
    outside: Path
    sibling: Path

    def outside_paths(self) -> list[Path]:
        """What must not change: the folders beside the root that its links lead to."""
        return [self.outside, self.sibling]


def build_hostile_root(root: Path, gguf: bytes) -> HostileRoot:
    """Fill the models root ``root`` with links out, to ``models2`` and ``outside`` beside it.

    ``gguf`` is a real GGUF, written to the files outside too, so a read that escaped
    would succeed (and answer 200) rather than fail on the content.
    """
    sibling = root.parent / "models2"  # the prefix trap: "models2" starts with "models"
    outside = root.parent / "outside"
    assert root.name == "models", "the links below name ../models2 and ../outside"
    for folder in (root / "good", root / "mixed", root / FETCHED, sibling / "victim", outside):
        folder.mkdir(parents=True)
    (root / "good" / "good.gguf").write_bytes(gguf)
    (outside / "secret.gguf").write_bytes(gguf)
    (outside / SENTINEL).write_bytes(gguf)
    (outside / "secret.txt").write_text("outside the models root\n")
    (sibling / "victim" / "victim.gguf").write_bytes(gguf)
    (sibling / "victim" / SENTINEL).write_bytes(gguf)

    (root / "link-out").symlink_to(outside)  # absolute
    (root / "link-rel").symlink_to(Path("..") / "outside")
    (root / "link-sibling").symlink_to(Path("..") / "models2")
    (root / "trap").symlink_to(Path("..") / "models2" / "victim")
    (root / "chain-a").symlink_to("chain-b")
    (root / "chain-b").symlink_to("chain-c")
    (root / "chain-c").symlink_to(Path("..") / "outside")
    (root / LINKED_IN).symlink_to("good")  # a chain that stays inside: allowed
    (root / "loop-a").symlink_to("loop-b")
    (root / "loop-b").symlink_to("loop-a")
    (root / "mixed" / "mixed.gguf").symlink_to(Path("..") / ".." / "outside" / "secret.gguf")
    (root / "mixed" / "sub").symlink_to(Path("..") / ".." / "outside")

    # A folder that looks fetched, whose manifest lists files that lead out.
    fetched = root / FETCHED
    (fetched / "own.gguf").write_bytes(b"own")
    (fetched / "sub").symlink_to(Path("..") / ".." / "outside")
    size = len(gguf)
    files = [
        {"name": name, "size": 3 if name == "own.gguf" else size} for name in FETCHED_MANIFEST_NAMES
    ]
    files.append({"name": str(outside / "secret.gguf"), "size": size})
    manifest = {"files": files, "source": {"repoId": "org/x", "revision": "r"}}
    (fetched / ".mirbad-fetched.json").write_text(json.dumps(manifest))
    return HostileRoot(root=root, outside=outside, sibling=sibling)


class Snapshot:
    """Every entry under some paths (links not followed): type, size and mtime."""

    def __init__(self, paths: list[Path]) -> None:
        self.entries: dict[str, tuple[str, int, int]] = {}
        for top in paths:
            self._add(top)
            if top.is_dir() and not top.is_symlink():
                for directory, dirnames, filenames in os.walk(top):
                    for name in dirnames + filenames:
                        self._add(Path(directory) / name)

    def _add(self, path: Path) -> None:
        info = path.lstat()
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        self.entries[str(path)] = (kind, info.st_size, info.st_mtime_ns)

    def changes(self, later: Snapshot) -> list[str]:
        """What was created, deleted or changed between this snapshot and ``later``."""
        out = [f"deleted {p}" for p in self.entries if p not in later.entries]
        out += [f"created {p}" for p in later.entries if p not in self.entries]
        out += [
            f"changed {p}"
            for p, entry in self.entries.items()
            if p in later.entries and later.entries[p] != entry
        ]
        return out


def segment(name: str) -> str:
    """``name`` as one URL path segment that no client or server resolves away."""
    if name and set(name) == {"."}:
        return "%2E" * len(name)
    return quote(name, safe="")
