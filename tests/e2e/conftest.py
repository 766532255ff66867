"""Real processes: ``./mirbad up`` as a user runs it, on free loopback ports.

A :class:`Stack` starts the launcher (web, enroll listener, monitor, Celery,
the local agent, Redis unless one is configured) in a temporary data
directory, reads its printed lines, and stops it at the end, killing anything
left behind that belongs to that directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psutil
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.parallel import engine_port_env, free_port, stack_redis_url

__all__ = ["free_port"]  # the e2e tests import it from here

ROOT = Path(__file__).resolve().parents[2]


def llama_server_or_fail() -> Path:
    """The llama-server ``./mirbad test`` laid out; its absence is an install failure."""
    value = os.environ.get("MIRBAD_TEST_LLAMA_SERVER")
    if value and Path(value).exists():
        return Path(value)
    message = (
        "MIRBAD_TEST_LLAMA_SERVER is not set to a llama-server: run the suite with "
        "'./mirbad test', which builds and lays out llama-server first"
    )
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def outside_env() -> dict[str, str]:
    """This process's environment without any MIRBAD_ setting, but for this worker's
    engine ports (tests.parallel): an agent started with it launches engines there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRBAD_")}
    return env | engine_port_env()


def install_llama_server(runtimes: Path, env: dict[str, str]) -> Path:
    """Lay out llama-server under ``runtimes`` with ``env``; returns its manifest."""
    subprocess.run(
        [sys.executable, "-m", "agent", "install-llama-server", "--runtimes-dir", str(runtimes)],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return next(runtimes.glob("llama.cpp/*/manifest.json"))


def run_join(
    env: dict[str, str], join: dict[str, Any], state: Path, address: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m agent join`` with the token, URL, CA hash and node id of ``join``."""
    return subprocess.run(
        [
            sys.executable, "-m", "agent", "join",
            "--enroll-url", join["enrollUrl"], "--ca-hash", join["caHash"],
            "--node-id", join["nodeId"], "--state-dir", str(state), "--address", address,
        ],
        cwd=ROOT, env={**env, "MIRBAD_JOIN_TOKEN": join["token"]},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


class Stack:
    def __init__(self, data: Path, env: dict[str, str]) -> None:
        self.data = data
        self.env = env
        self.port = int(env["MIRBAD_PORT"])
        self.process: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, key: str, timeout: float = 60) -> httpx.Client:
        """An httpx client for this stack that sends ``key`` as its bearer token."""
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def prepare_local_model(self) -> None:
        """Install llama-server for the local agent and write the tiny GGUF to models/tiny."""
        install_llama_server(self.data / "agent" / "runtimes", self.env)
        write_tiny_gguf(self.data / "models" / "tiny" / "tiny.gguf")

    def start(self, *args: str, timeout: float = 240.0) -> dict[str, str]:
        self.lines = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mirbad_site.launcher", "up", *args],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "Ready." in self.lines:
                return self.facts()
            if self.process.poll() is not None:
                time.sleep(0.5)
                break
            time.sleep(0.2)
        self.print_logs()
        raise AssertionError("mirbad up did not print Ready.:\n" + "\n".join(self.lines))

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def facts(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.lines:
            for key in ("Console", "Admin", "API key"):
                if line.startswith(f"{key}: "):
                    out[key] = line[len(key) + 2 :]
            if line.startswith("curl "):
                out["curl"] = line
        return out

    def pid(self, name: str) -> int:
        return int((self.data / "run" / f"{name}.pid").read_text())

    @contextlib.contextmanager
    def second_web_process(self, timeout: float = 30.0) -> Iterator[str]:
        """One more web process of this master (same data, database and Redis), as a
        second worker behind a load balancer; yields its URL once /healthz answers 200,
        and stops it at the end."""
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "mirbad_site.asgi:application",
             "--host", "127.0.0.1", "--port", str(port), "--lifespan", "on", "--no-access-log"],
            cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _healthy(url), timeout, "the second web process")
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)

    def stop(self, timeout: float = 60.0) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise

    def print_logs(self) -> None:
        for log in sorted((self.data / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-30:]
            print(f"--- {log.name} ---\n" + "\n".join(tail))

    def leftovers(self) -> list[psutil.Process]:
        """Processes still running that were started for this data directory."""
        found = []
        marker = str(self.data)
        for proc in psutil.process_iter(["cmdline", "environ"]):
            try:
                cmd = " ".join(proc.info["cmdline"] or [])
                env = proc.info.get("environ") or {}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if proc.pid == os.getpid():
                continue
            if marker in cmd or env.get("MIRBAD_DATA_PATH") == marker:
                found.append(proc)
        return found

    def kill_leftovers(self) -> None:
        for proc in self.leftovers():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _fresh_database(env: dict[str, str]) -> tuple[str, str] | None:
    """A new PostgreSQL database on the configured server, or None for SQLite."""
    url = env.get("MIRBAD_DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        return None
    import psycopg

    name = f"mirbad_e2e_{uuid.uuid4().hex[:10]}"
    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin, urlunsplit(parts._replace(path=f"/{name}"))


@pytest.fixture
def make_stack(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """Build a stack; ``embedded=True`` drops the configured DB and Redis (the default)."""
    stacks: list[Stack] = []
    databases: list[tuple[str, str]] = []

    def build(*, embedded: bool) -> Stack:
        data = tmp_path / f"var{len(stacks)}"
        env = outside_env()
        env.update(
            {
                "MIRBAD_DATA_PATH": str(data),
                "MIRBAD_PORT": str(free_port()),
                "MIRBAD_ENROLL_PORT": str(free_port()),
                "MIRBAD_AGENT_PORT": str(free_port()),
                "MIRBAD_BUILD_CACHE": os.environ.get(
                    "MIRBAD_BUILD_CACHE", str(Path.home() / ".cache" / "mirbad" / "llama-server")
                ),
            }
        )
        if not embedded:
            for key in ("MIRBAD_DATABASE_URL", "MIRBAD_REDIS_URL"):
                if os.environ.get(key):
                    env[key] = os.environ[key]
            created = _fresh_database(env)
            if created:
                databases.append(created)
                env["MIRBAD_DATABASE_URL"] = created[1]
            if env.get("MIRBAD_REDIS_URL") and stack_redis_url():
                # A database of its own on the shared server (this worker's: tests.parallel),
                # emptied first.
                import redis

                env["MIRBAD_REDIS_URL"] = stack_redis_url()
                redis.Redis.from_url(env["MIRBAD_REDIS_URL"]).flushdb()
        stack = Stack(data, env)
        stacks.append(stack)
        return stack

    yield build
    for stack in stacks:
        if stack.process is not None and stack.process.poll() is None:
            stack.stop()
        stack.kill_leftovers()
    for admin, url in databases:
        import psycopg

        name = urlsplit(url).path.lstrip("/")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def create_and_start(api: httpx.Client, body: dict[str, Any], *, timeout: float = 60) -> int:
    """Create a model from ``body``, start it and wait until it is Ready; returns its id.

    A llama.cpp model gets one thread unless the body says otherwise: llama-server takes
    a thread per core by default, and its threads wait for each other by spinning, so
    two of them on two cores shared with another test (or a busy core) make every token
    wait for the scheduler; the tiny model needs no more than one.
    """
    if body.get("runtime", "llamacpp") == "llamacpp":
        body = {**body, "settings": {"threads": 1, **body.get("settings", {})}}
    created = api.post("/api/models", json=body)
    assert created.status_code == 201, created.text
    model_id = created.json()["id"]
    started = api.post(f"/api/models/{model_id}/start")
    assert started.status_code == 202, started.text
    wait_for(
        lambda: api.get(f"/api/models/{model_id}").json()["state"] == "Ready", timeout, "Ready"
    )
    return model_id


def join_agent(
    api: httpx.Client, stack: Stack, folder: Path, node_id: str, ip: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """Join one more real agent on ``ip`` with a token, with llama-server; not yet approved.

    Returns the agent process and its models root. ``api`` is an httpx client with
    an admin key.
    """
    env = outside_env()
    runtimes = folder / "runtimes"
    if runtimes.exists():  # a second agent in the same folder shares the first one's install
        manifest = next(runtimes.glob("llama.cpp/*/manifest.json"))
    else:
        manifest = install_llama_server(
            runtimes, {**env, "MIRBAD_BUILD_CACHE": stack.env["MIRBAD_BUILD_CACHE"]}
        )
    port = free_port()
    address = f"https://{ip}:{port}"
    join = api.post("/api/join-tokens", json={"nodeId": node_id}).json()
    state = folder / node_id / "state"
    joined = run_join(env, join, state, address)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    models = folder / node_id / "models"
    models.mkdir(parents=True, exist_ok=True)
    config = folder / node_id / "agent.json"
    config.write_text(
        json.dumps(
            {
                "NodeId": node_id,
                "StateDirectory": str(state),
                "ListenAddress": ip,
                "Port": port,
                "ModelsRoot": str(models),
                "StopInstancesOnShutdown": True,
                "Executables": [
                    {
                        "Name": "llama.cpp",
                        "Version": json.loads(manifest.read_text())["version"],
                        "Path": str(manifest.parent / "llama-server"),
                        "Default": True,
                    }
                ],
            }
        )
    )
    log = open(folder / f"{node_id}.log", "ab")  # the child keeps writing to it
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(config)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return agent, models
