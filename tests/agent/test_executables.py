"""Executable catalogue: manifest verification and resolution."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agent import ExecutableUnverified, SpecRejected
from agent._config import ExecutableEntry
from agent.engines._executables import Catalogue, verify_folder, write_manifest


def make_folder(root: Path, version: str = "1.0") -> ExecutableEntry:
    folder = root / "llama.cpp" / version
    folder.mkdir(parents=True)
    binary = folder / "llama-server"
    binary.write_bytes(b"#!/bin/sh\necho binary\n")
    binary.chmod(0o755)
    (folder / "libllama.so.0.6.0").write_bytes(b"\x7fELF library")
    os.symlink("libllama.so.0.6.0", folder / "libllama.so.0")
    write_manifest(folder, name="llama.cpp", version=version)
    return ExecutableEntry(name="llama.cpp", version=version, path=binary, default=False)


def verify(entry: ExecutableEntry) -> str | None:
    return verify_folder(
        entry.path.parent, name=entry.name, version=entry.version, binary="llama-server"
    )


def test_manifest_shape_and_verified(tmp_path: Path) -> None:
    entry = make_folder(tmp_path)
    manifest = json.loads((entry.path.parent / "manifest.json").read_text())
    assert manifest["name"] == "llama.cpp" and manifest["version"] == "1.0"
    assert set(manifest["files"]) == {"llama-server", "libllama.so.0.6.0"}
    assert manifest["files"]["llama-server"]["size"] == entry.path.stat().st_size
    assert len(manifest["files"]["llama-server"]["sha256"]) == 64
    assert manifest["links"] == {"libllama.so.0": "libllama.so.0.6.0"}
    assert verify(entry) is None


def test_tampered_file_is_unverified(tmp_path: Path) -> None:
    entry = make_folder(tmp_path)
    data = entry.path.read_bytes()
    entry.path.write_bytes(data.replace(b"binary", b"BINARY"))  # same size, new content
    assert "does not match its SHA-256" in (verify(entry) or "")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda f: (f / "libevil.so").write_bytes(b"x"), "libevil.so is not listed"),
        (lambda f: os.symlink("/etc/passwd", f / "libother.so.1"), "libother.so.1 is not listed"),
        (lambda f: (f / "libllama.so.0").unlink(), "link libllama.so.0 is missing"),
        (lambda f: (f / "libllama.so.0.6.0").write_bytes(b"longer content"), "has size"),
        (lambda f: (f / "manifest.json").unlink(), "does not exist"),
    ],
)
def test_folder_changes_are_unverified(
    tmp_path: Path, change: Callable[[Path], object], needle: str
) -> None:
    entry = make_folder(tmp_path)
    change(entry.path.parent)
    assert needle in (verify(entry) or "")


def test_readme_does_not_matter(tmp_path: Path) -> None:
    entry = make_folder(tmp_path)
    (entry.path.parent / "README.txt").write_text("notes")
    assert verify(entry) is None


def test_catalogue_resolve(tmp_path: Path) -> None:
    good = make_folder(tmp_path, "1.0")
    bad = make_folder(tmp_path, "2.0")
    bad.path.write_bytes(b"tampered")
    catalogue = Catalogue(
        entries=(good, ExecutableEntry(name=bad.name, version="2.0", path=bad.path, default=True))
    )
    infos = catalogue.verify()
    assert [(i.version, i.verified, i.default) for i in infos] == [
        ("1.0", True, False),
        ("2.0", False, True),
    ]
    assert catalogue.resolve("llama.cpp", "1.0").path == good.path
    with pytest.raises(ExecutableUnverified, match=r"2\.0 does not match its manifest"):
        catalogue.resolve("llama.cpp", None)
    with pytest.raises(SpecRejected, match="not configured"):
        catalogue.resolve("llama.cpp", "3.0")
    with pytest.raises(SpecRejected, match="'vllm' is not configured"):
        catalogue.resolve("vllm", None)
    [reason] = catalogue.health_reasons()
    assert reason["code"] == "executable_unverified" and "2.0" in reason["message"]


def test_single_entry_is_the_default(tmp_path: Path) -> None:
    entry = make_folder(tmp_path)
    catalogue = Catalogue(entries=(entry,))
    catalogue.verify()
    assert catalogue.resolve("llama.cpp", None).version == "1.0"
    assert catalogue.infos[0].to_json() == {
        "name": "llama.cpp",
        "version": "1.0",
        "default": True,
        "verified": True,
    }


def test_missing_binary_is_unverified(tmp_path: Path) -> None:
    entry = ExecutableEntry(name="llama.cpp", version="1", path=tmp_path / "nope", default=True)
    catalogue = Catalogue(entries=(entry,))
    [info] = catalogue.verify()
    assert not info.verified and "does not exist" in (info.problem or "")
