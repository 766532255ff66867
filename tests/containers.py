"""A Docker-API engine on this machine, for the container tests: Podman serving the
Docker API on a socket of its own, and an engine image built here from the test
llama-server (there is no registry to pull one from).

`podman_socket` starts `podman system service` with a containers.conf of ours
(runc, and the lower ulimits this sandbox allows: docs/deploy.md once the compose
issue lands); `engine_image` lays out a root file system with llama-server, every
library `ldd` names and the dynamic loader, and imports it with an ENTRYPOINT.
Both fail, never skip, when Podman is missing: `./mirbad test` installs it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
"""
ENGINE_DIR = "/opt/llama"


# Podman keeps one image store and one container namespace per machine, and its tests
# name their containers and clear every container labelled as a node's: two xdist workers
# running them at once break each other. Each module that uses Podman holds this lock
# for as long as its module fixtures live (``pytestmark =
# pytest.mark.usefixtures("podman_serial")``); it is re-entrant within a worker, which may
# interleave two such modules, and a worker waiting on it waits for another worker's
# module to finish, never for itself.
_LOCK_PATH = Path(tempfile.gettempdir()) / "mirbad-tests-podman.lock"
_lock_state = {"depth": 0, "fd": -1}
_lock_guard = threading.Lock()


@contextlib.contextmanager
def podman_serial_lock() -> Iterator[None]:
    """Hold the machine-wide Podman test lock (re-entrant in this process)."""
    with _lock_guard:
        if _lock_state["depth"] == 0:
            fd = os.open(_LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            _lock_state["fd"] = fd
        _lock_state["depth"] += 1
    try:
        yield
    finally:
        with _lock_guard:
            _lock_state["depth"] -= 1
            if _lock_state["depth"] == 0:
                os.close(_lock_state["fd"])  # closing the descriptor releases the flock
                _lock_state["fd"] = -1


def podman_env(folder: Path, registries: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a Podman of ours; with ``registries`` (``host:port`` each), one
    that pulls from those registries over plain HTTP into a store of its own in
    ``folder``: the shared store already holds the engine image's layers, and a pull
    that finds them there fetches nothing."""
    conf = folder / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    if registries:
        listed = folder / "registries.conf"
        listed.write_text(
            "".join(f'[[registry]]\nlocation = "{r}"\ninsecure = true\n\n' for r in registries)
        )
        storage = folder / "storage.conf"
        storage.write_text(
            f'[storage]\ndriver = "vfs"\n'
            f'graphroot = "{folder / "store"}"\nrunroot = "{folder / "run"}"\n'
        )
        env["CONTAINERS_REGISTRIES_CONF"] = str(listed)
        env["CONTAINERS_STORAGE_CONF"] = str(storage)
    return env


def _podman() -> str:
    found = shutil.which("podman")
    if found is None:
        raise AssertionError("podman is not installed: 'apt-get install podman runc'")
    return found


@contextlib.contextmanager
def podman_socket(
    folder: Path, registries: Sequence[str] = ()
) -> Iterator[tuple[Path, dict[str, str]]]:
    """A Podman Docker-API service on ``folder/podman.sock``, stopped afterwards
    (``registries``: see :func:`podman_env`; read once, when the service starts)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = podman_env(folder, registries)
    socket = folder / "podman.sock"
    service = subprocess.Popen(
        [_podman(), "system", "service", "--time=0", f"unix://{socket}"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(folder / "podman.log", "wb"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "podman system service did not start: "
                    + (folder / "podman.log").read_text(errors="replace")[-2000:]
                )
            time.sleep(0.1)
        yield socket, env
    finally:
        service.terminate()
        try:
            service.wait(10)
        except subprocess.TimeoutExpired:
            service.kill()


def _libraries(binary: Path) -> list[Path]:
    """What the dynamic loader resolves for ``binary`` (``ldd``), the loader included."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        match = re.search(r"(/\S+)", line.split("=>")[-1])
        if match:
            found.append(Path(match[1]))
    return found


def engine_image(llama_server: Path, env: dict[str, str], folder: Path) -> str:
    """An image whose entrypoint is llama-server, named by the build's content."""
    build_dir = llama_server.parent
    digest = hashlib.sha256(llama_server.read_bytes()).hexdigest()[:12]
    name = f"localhost/mirbad-test-engine:{digest}"
    have = subprocess.run([_podman(), "image", "exists", name], env=env, check=False)
    if have.returncode == 0:
        return name
    rootfs = folder / "rootfs"
    target = rootfs / ENGINE_DIR.lstrip("/")
    shutil.copytree(build_dir, target, symlinks=True)
    for lib in _libraries(llama_server):
        if lib.is_relative_to(build_dir):
            continue
        destination = target / lib.name
        if not destination.exists():
            shutil.copy2(lib.resolve(), destination)
    loader = Path("/lib64/ld-linux-x86-64.so.2")
    (rootfs / "lib64").mkdir(exist_ok=True)
    shutil.copy2(loader.resolve(), rootfs / "lib64" / loader.name)
    (rootfs / "tmp").mkdir(mode=0o1777, exist_ok=True)
    archive = folder / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(rootfs, arcname=".")
    subprocess.run(
        [_podman(), "import",
         "--change", f'ENTRYPOINT ["{ENGINE_DIR}/llama-server"]',
         "--change", f"ENV LD_LIBRARY_PATH={ENGINE_DIR}",
         str(archive), name],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return name
