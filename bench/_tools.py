"""The benchmark's tools: Debian's nginx and wrk, and LiteLLM in a virtualenv of its own.

Installed here, by the benchmark, when missing (never at test time), and each install is
printed. The LiteLLM venv is cached: a marker file holding the pinned requirement is
written only after pip succeeded, so a second run reuses it and a broken one is redone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

LITELLM_REQUIREMENT = "litellm[proxy]==1.80.5"
MARKER = ".mirbad-bench-installed"


def say(line: str) -> None:
    print(f"bench: {line}", flush=True)


def loud(line: str) -> None:
    bar = "!" * 78
    print(f"\n{bar}\n!! {line}\n{bar}\n", flush=True)


def default_litellm_venv() -> Path:
    override = os.environ.get("MIRBAD_BENCH_LITELLM_VENV")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "mirbad" / "bench-litellm"


def ensure_debian(binaries: dict[str, str]) -> dict[str, str | None]:
    """{binary: package}; installs the missing ones with apt-get; returns found paths."""
    missing = sorted({pkg for binary, pkg in binaries.items() if not _which(binary)})
    if missing:
        apt = shutil.which("apt-get")
        if apt is None or os.geteuid() != 0:
            say(f"cannot install {', '.join(missing)}: needs root and apt-get")
        else:
            say(f"installing Debian packages: {' '.join(missing)} (apt-get install -y)")
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            done = subprocess.run(
                [apt, "install", "-y", "--no-install-recommends", *missing], env=env, check=False
            )
            if done.returncode != 0:
                say("apt-get install failed; running apt-get update and trying once more")
                subprocess.run([apt, "update"], env=env, check=False)
                subprocess.run(
                    [apt, "install", "-y", "--no-install-recommends", *missing],
                    env=env,
                    check=False,
                )
    return {binary: _which(binary) for binary in binaries}


def _which(binary: str) -> str | None:
    return shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin:/bin")


def ensure_litellm(venv: Path) -> Path:
    """The ``litellm`` executable of the cached venv, installing it first when needed."""
    exe = venv / "bin" / "litellm"
    marker = venv / MARKER
    if exe.is_file() and marker.is_file() and marker.read_text().strip() == LITELLM_REQUIREMENT:
        return exe
    python = _base_python()
    say(f"installing {LITELLM_REQUIREMENT} into {venv} (once; cached)")
    if not (venv / "bin" / "python").is_file():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", LITELLM_REQUIREMENT],
        check=True,
    )
    if not exe.is_file():
        raise RuntimeError(f"pip installed {LITELLM_REQUIREMENT} but {exe} does not exist")
    marker.write_text(LITELLM_REQUIREMENT + "\n")
    return exe


def _base_python() -> str:
    """The interpreter our venv was made from (so LiteLLM runs on the same Python)."""
    base = getattr(sys, "_base_executable", None)
    if base and Path(base).is_file() and Path(base).resolve() != Path(sys.executable).resolve():
        return base
    return shutil.which("python3") or sys.executable


def version_of(argv: list[str], pattern: str) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(pattern, done.stdout + done.stderr)
    return match.group(1) if match else None


def litellm_version(venv: Path) -> str | None:
    return version_of(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print('litellm', m.version('litellm'))",
        ],
        r"litellm (\S+)",
    )
