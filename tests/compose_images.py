"""The images of docker-compose.yml, built on this machine, which has no registry.

One Debian bookworm root file system (debootstrap, minbase, with Python, PostgreSQL,
Redis and what llama-server links) is the base of all of them: the master and agent
image is the repository's own Dockerfile built on it (``BASE``), with its Python
packages from ``deploy/wheelhouse/`` (``pip download`` here, ``--no-index`` in the
build), and PostgreSQL and Redis get a small stage each that plays the part of the
official images the compose names (docs/deploy.md, "Podman").

Each image is named by a hash of its inputs and built only when that name is missing;
the debootstrap tarball is kept under ``~/.cache/mirbad/images/`` (``MIRBAD_IMAGE_CACHE``),
so only a first build takes minutes. Everything fails, never skips, when a tool is
missing: ``./mirbad test`` installs them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / "deploy" / "wheelhouse"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# libgomp1: llama-server links it (ldd); the rest is the three services' software.
PACKAGES = ("python3", "python3-venv", "ca-certificates", "postgresql", "redis-server", "libgomp1")
BASE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)
# The wheels the image installs: CPython 3.11 on glibc x86_64, like Debian 12's python3.
WHEEL_PLATFORM = (
    "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
)  # fmt: skip
# pip download evaluates markers with the host's Python, not the image's: what the
# image's Python (bookworm's 3.11.2) needs beyond that is named here.
EXTRA_WHEELS = ("async-timeout>=4.0.3",)  # redis, below Python 3.11.3

# The part of the official postgres image's contract the compose relies on: the
# POSTGRES_* variables and a data folder initialised at the first start.
POSTGRES_ENTRYPOINT = """\
#!/bin/sh
set -eu
bin=$(echo /usr/lib/postgresql/*/bin)
data="${PGDATA:-/var/lib/postgresql/data}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
if [ ! -s "$data/PG_VERSION" ]; then
    "$bin/initdb" --pgdata="$data" --username="$user" --auth=trust \\
        --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    echo "host all all all ${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}" >>"$data/pg_hba.conf"
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \\"$db\\"" | "$bin/postgres" --single -D "$data" postgres >/dev/null
    fi
fi
exec "$bin/postgres" -D "$data" -c listen_addresses='*'
"""
POSTGRES_CONTAINERFILE = """\
FROM {base}
COPY entrypoint.sh /usr/local/bin/mirbad-postgres
RUN chmod 0755 /usr/local/bin/mirbad-postgres \\
 && mkdir -p /var/lib/postgresql/data /var/run/postgresql \\
 && chown postgres:postgres /var/lib/postgresql/data /var/run/postgresql \\
 && chmod 0700 /var/lib/postgresql/data
USER postgres
ENV PGDATA=/var/lib/postgresql/data
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/mirbad-postgres"]
"""
# The official redis image turns protected mode off (it is reached over the compose
# network, without a password); Debian's binary keeps it on.
REDIS_ENTRYPOINT = """\
#!/bin/sh
exec "$@" --protected-mode no
"""
REDIS_CONTAINERFILE = """\
FROM {base}
COPY entrypoint.sh /usr/local/bin/mirbad-redis
RUN chmod 0755 /usr/local/bin/mirbad-redis && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["/usr/local/bin/mirbad-redis"]
CMD ["redis-server"]
"""


@dataclass(frozen=True)
class ComposeImages:
    app: str
    postgres: str
    redis: str


def cache_dir() -> Path:
    value = os.environ.get("MIRBAD_IMAGE_CACHE")
    return Path(value) if value else Path.home() / ".cache" / "mirbad" / "images"


def _tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed: 'apt-get install {package}'")
    return found


def _key(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _say(message: str) -> None:
    print(f"compose images: {message}", file=sys.stderr, flush=True)


def _run(args: list[str], env: dict[str, str], what: str, log: Path) -> None:
    """Run a long build step, its output in ``log``; failing, raise with its tail."""
    started = time.monotonic()
    with open(log, "ab") as out:
        done = subprocess.run(args, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise AssertionError(f"{what} failed (exit {done.returncode}):\n{tail}")
    _say(f"{what}: {time.monotonic() - started:.0f} s")


def _exists(image: str, env: dict[str, str]) -> bool:
    done = subprocess.run(
        [_tool("podman", "podman"), "image", "exists", image], env=env, check=False
    )
    return done.returncode == 0


def rootfs_tarball() -> Path:
    """The debootstrap root file system as a tarball, made once per package list."""
    key = _key(SUITE, MIRROR, "minbase", *PACKAGES)
    tarball = cache_dir() / f"debian-{SUITE}-{key}.tar"
    if tarball.exists():
        return tarball
    debootstrap = _tool("debootstrap", "debootstrap")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log = tarball.parent / f"debootstrap-{key}.log"
        log.unlink(missing_ok=True)
        _say(f"debootstrap {SUITE} into {rootfs} (minutes; log {log})")
        _run(
            [debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}",
             SUITE, str(rootfs), MIRROR],
            dict(os.environ), "debootstrap", log,
        )  # fmt: skip
        # The downloaded packages and lists are half of the size and no image uses them.
        for leftover in [
            *(rootfs / "var/cache/apt/archives").glob("*.deb"),
            *(rootfs / "var/lib/apt/lists").glob("*_*"),
        ]:
            leftover.unlink()
        partial = Path(tmp) / "rootfs.tar"
        _run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."],
             dict(os.environ), "tar of the root file system", log)  # fmt: skip
        os.replace(partial, tarball)
    return tarball


def base_image(env: dict[str, str], log: Path) -> str:
    tarball = rootfs_tarball()
    name = f"localhost/mirbad-base:{_key(tarball.name, *BASE_CHANGES)}"
    if _exists(name, env):
        return name
    changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
    _run([_tool("podman", "podman"), "import", *changes, str(tarball), name], env,
         f"podman import {name}", log)  # fmt: skip
    return name


def _stage(
    repository: str, containerfile: str, entrypoint: str, base: str, env: dict[str, str], log: Path
) -> str:
    text = containerfile.format(base=base)
    name = f"localhost/{repository}:{_key(text, entrypoint)}"
    if _exists(name, env):
        return name
    with tempfile.TemporaryDirectory(prefix=f"{repository}-") as tmp:
        (Path(tmp) / "Containerfile").write_text(text)
        (Path(tmp) / "entrypoint.sh").write_text(entrypoint)
        _run([_tool("podman", "podman"), "build", "--network", "none", "-t", name, tmp], env,
             f"podman build {name}", log)  # fmt: skip
    return name


def fill_wheelhouse(log: Path) -> None:
    """``pip download`` of requirements.txt into deploy/wheelhouse/, once per its content."""
    requirements = ROOT / "requirements.txt"
    stamp = (
        WHEELHOUSE / f".filled-{_key(requirements.read_bytes(), *WHEEL_PLATFORM, *EXTRA_WHEELS)}"
    )
    if stamp.exists():
        return
    _run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "-r", str(requirements), *EXTRA_WHEELS, "-d", str(WHEELHOUSE), *WHEEL_PLATFORM],
        dict(os.environ), "pip download into deploy/wheelhouse", log,
    )  # fmt: skip
    for old in WHEELHOUSE.glob(".filled-*"):
        old.unlink()
    stamp.touch()


def _copied_sources(dockerfile: Path) -> list[Path]:
    """The context paths the Dockerfile's COPY lines name."""
    found = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if len(words) >= 3 and words[0].upper() == "COPY" and not words[1].startswith("--"):
            found.extend(ROOT / word for word in words[1:-1])
    return found


def _tree_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def app_image(base: str, env: dict[str, str], log: Path) -> str:
    """The repository's Dockerfile on ``base``, its packages from the wheelhouse only."""
    fill_wheelhouse(log)
    dockerfile = ROOT / "Dockerfile"
    build_args = [f"BASE={base}", "PIP_OPTIONS=--no-index"]
    sources = _copied_sources(dockerfile)
    name = (
        f"localhost/mirbad-app:{_key(dockerfile.read_bytes(), *build_args, _tree_digest(sources))}"
    )
    if _exists(name, env):
        return name
    args = [arg for value in build_args for arg in ("--build-arg", value)]
    _run(
        [_tool("podman", "podman"), "build", "--network", "none", *args,
         "-f", str(dockerfile), "-t", name, str(ROOT)],
        env, f"podman build {name}", log,
    )  # fmt: skip
    # Each change of the sources makes a new tag; the older ones are dead weight.
    listed = subprocess.run(
        [_tool("podman", "podman"), "images", "--format", "{{.Repository}}:{{.Tag}}",
         "localhost/mirbad-app"],
        env=env, capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    stale = [tag for tag in listed if tag != name and tag.startswith("localhost/mirbad-app:")]
    if stale:
        subprocess.run([_tool("podman", "podman"), "rmi", *stale], env=env,
                       capture_output=True, check=False)  # fmt: skip
    return name


def build_images(env: dict[str, str], folder: Path) -> ComposeImages:
    """Every image the compose needs, built or found; ``env`` is Podman's (CONTAINERS_CONF)."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "images.log"
    base = base_image(env, log)
    return ComposeImages(
        app=app_image(base, env, log),
        postgres=_stage(
            "mirbad-postgres", POSTGRES_CONTAINERFILE, POSTGRES_ENTRYPOINT, base, env, log
        ),
        redis=_stage("mirbad-redis", REDIS_CONTAINERFILE, REDIS_ENTRYPOINT, base, env, log),
    )
