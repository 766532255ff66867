"""The production compose, really run (issue 16): docker-compose.yml on Podman.

The images are built here (tests/compose_images.py: no registry), Podman serves the
Docker API on a socket of the test's own, which the compose's agent mounts, and
podman-compose brings the stack up under a project name of its own, on free ports,
with the models and llama-server as bind mounts. Then, as an operator would: the
master answers, an admin key is made in the web container, the compose's agent is
Online, the tiny model runs as a llama.cpp process on it and as a container on the
compose network (through the Docker socket), both answer /v1; a second agent on this
host joins through the published enroll port and is approved; the stack is taken down
without its volumes and brought up again: the nodes, the key and the models are there,
the process model serves again, and the engine container, which ran on through the
restart, is adopted by the new agent (the same container, not started again) and
answers; then it is stopped and removed.
Everything of the project (containers, engines, volumes, network) is removed at the
end, whatever happened; the services' logs are printed on a failure.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.compose_images import build_images
from tests.containers import engine_image, podman_socket
from tests.e2e.conftest import (
    ROOT,
    free_port,
    llama_server_or_fail,
    outside_env,
    run_join,
    wait_for,
)

# A cold cache builds the root file system and the images first (docs/deploy.md).
# Podman's store and container names are one per machine (tests/containers.py).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.usefixtures("podman_serial")]

FILES = ("docker-compose.yml", "deploy/compose/local-images.yml")
SERVICES = ("db", "redis", "migrate", "web", "enroll", "monitor", "worker", "beat", "agent")
# What an operator runs for a first key (docs/deploy.md, "First start").
MAKE_KEY = (
    "from router import keys; print(keys.create_key(name='compose test', "
    "scopes=['chat', 'completions', 'embeddings', 'rerank', 'admin'])[1])"
)
TINY = {
    "servedName": "tiny",
    "sourceFolder": "tiny",
    "sourceFile": "tiny.gguf",
    "settings": {"context_size": 256, "parallel": 1, "gpu_layers": 0},
    "autoStart": True,
}
REMOTE = "remote-1"


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed: 'apt-get install {name}'")
    return found


def _phase(started: float, what: str) -> None:
    print(
        f"compose test: {what} at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True
    )


class Project:
    """One podman-compose project of the test, and everything it leaves behind."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.name = f"mirbad-compose-{suffix}"
        # Engine containers are labelled with the node id, and an agent removes the ones
        # of its id that it has no record of: other stacks on this Podman say "local".
        self.node = f"compose-{suffix}"
        self.network = f"{self.name}_net"
        self.folder = folder
        self.env = env
        self.log = folder / "podman-compose.log"

    def podman(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        done = subprocess.run(
            [_tool("podman"), *args], env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {done.stderr[-2000:]}")
        return done.stdout

    def logs(self, container: str, lines: int) -> str:
        """A container's output; the services write their logs to stderr."""
        done = subprocess.run(
            [_tool("podman"), "logs", "--tail", str(lines), container], env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60, check=False,
        )  # fmt: skip
        return done.stdout

    def compose(self, *args: str, timeout: float = 300) -> None:
        files = [arg for name in FILES for arg in ("-f", name)]
        with open(self.log, "a") as out:
            done = subprocess.run(
                [_tool("podman-compose"), "-p", self.name, *files, *args],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout, check=False,
            )  # fmt: skip
        if done.returncode != 0:
            tail = self.log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"podman-compose {' '.join(args)} failed:\n{tail}")

    def create_network(self) -> str:
        """The compose's network, made first so its gateway is known before `up`."""
        self.podman("network", "create", "--label", f"io.podman.compose.project={self.name}",
                    self.network)  # fmt: skip
        gateway = self.podman(
            "network", "inspect", self.network, "--format", "{{range .Subnets}}{{.Gateway}}{{end}}"
        ).strip()
        assert gateway, f"no gateway on {self.network}"
        return gateway

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def exec(self, service: str, *command: str) -> str:
        return self.podman("exec", self.container(service), *command, timeout=60)

    def print_logs(self) -> None:
        for service in SERVICES:
            print(f"--- {service} ---\n{self.logs(self.container(service), 60)}")
        engines = self.podman("ps", "-a", "--filter", f"network={self.network}",
                              "--format", "{{.Names}}", check=False).split()  # fmt: skip
        for name in engines:
            if name.startswith("ss-"):
                print(f"--- engine {name} ---\n{self.logs(name, 20)}")

    def destroy(self) -> None:
        """Containers (the agent's engines too), volumes and network of this project only."""
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            self.compose("down", "-v", "-t", "5", timeout=180)
        for selector in (f"label=io.podman.compose.project={self.name}", f"network={self.network}"):
            ids = self.podman("ps", "-aq", "--filter", selector, check=False).split()
            if ids:
                self.podman("rm", "-f", "-t", "5", *ids, check=False)
        volumes = self.podman("volume", "ls", "-q", "--filter",
                              f"label=io.podman.compose.project={self.name}", check=False).split()  # fmt: skip
        if volumes:
            self.podman("volume", "rm", "-f", *volumes, check=False)
        self.podman("network", "rm", "-f", self.network, check=False)


@contextlib.contextmanager
def outside_agent(api: httpx.Client, folder: Path, ip: str, server: Path) -> Iterator[Path]:
    """A second agent on this host, joined through the published enroll port."""
    env = outside_env()
    join = api.post("/api/join-tokens", json={"nodeId": REMOTE}).json()
    port = free_port()
    state = folder / REMOTE / "state"
    joined = run_join(env, join, state, f"https://{ip}:{port}")
    assert joined.returncode == 0, joined.stdout + joined.stderr
    models = folder / REMOTE / "models"
    models.mkdir(parents=True)
    version = json.loads((server.parent / "manifest.json").read_text())["version"]
    config = folder / REMOTE / "agent.json"
    config.write_text(json.dumps({
        "NodeId": REMOTE, "StateDirectory": str(state), "ListenAddress": ip, "Port": port,
        "ModelsRoot": str(models), "StopInstancesOnShutdown": True,
        "Executables": [{"Name": "llama.cpp", "Version": version, "Path": str(server),
                         "Default": True}],
    }))  # fmt: skip
    log = folder / f"{REMOTE}.log"
    with open(log, "ab") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(config)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield log
    finally:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(10)


def reach(api: httpx.Client, path: str, want: str, timeout: float) -> None:
    """Wait until the resource at ``path`` is in state ``want``; else fail showing it."""
    seen: list[Any] = [None]

    def there() -> bool:
        answer = api.get(path)
        seen[0] = answer.json() if answer.status_code == 200 else answer.status_code
        return isinstance(seen[0], dict) and seen[0].get("state") == want

    try:
        wait_for(there, timeout, f"{path} {want}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last answer: {json.dumps(seen[0])[:3000]}") from None


def chat(url: str, key: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip


def engines(project: Project) -> list[str]:
    """The engine containers on the compose network (the agent names them ss-<instance>)."""
    names = project.podman("ps", "-a", "--filter", f"network={project.network}",
                           "--format", "{{.Names}}").split()  # fmt: skip
    return [name for name in names if name.startswith("ss-")]


def healthy(url: str) -> bool:
    try:
        answer = httpx.get(f"{url}/healthz", timeout=5)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and answer.json().get("status") == "ok"


def test_the_production_compose_on_podman(tmp_path: Path) -> None:
    server = llama_server_or_fail()
    _tool("podman-compose")
    started = time.monotonic()
    with podman_socket(tmp_path / "podman") as (sock, podman_env):
        images = build_images(podman_env, tmp_path / "images")
        engine = engine_image(server, podman_env, tmp_path / "engine")
        _phase(started, "images ready")
        env = {k: v for k, v in podman_env.items() if not k.startswith("MIRBAD_")}
        project = Project(tmp_path, env)
        try:
            gateway = project.create_network()
            http_port, enroll_port = free_port(), free_port()
            models = tmp_path / "models"
            write_tiny_gguf(models / "tiny" / "tiny.gguf")
            env.update({
                "MIRBAD_IMAGE": images.app,
                "MIRBAD_POSTGRES_IMAGE": images.postgres,
                "MIRBAD_REDIS_IMAGE": images.redis,
                "MIRBAD_NETWORK": project.network,
                "MIRBAD_BOOTSTRAP_NODE_ID": project.node,
                "MIRBAD_HTTP_PUBLISH": f"127.0.0.1:{http_port}",
                # Remote machines and the compose's own agent reach the enroll listener
                # the same way: through the published port, on the host's address.
                "MIRBAD_ENROLL_PUBLISH": f"{gateway}:{enroll_port}",
                "MIRBAD_ENROLL_ENDPOINT": f"https://{gateway}:{enroll_port}",
                "MIRBAD_MASTER_KEY": secrets.token_urlsafe(32),
                "MIRBAD_MODELS_DIR": str(models),
                "MIRBAD_LLAMA_SERVER_DIR": str(server.parent),
                "MIRBAD_DOCKER_SOCKET": str(sock),
                "MIRBAD_AGENT_ALLOW_TAG_PULLS": "true",  # the engine image has no digest to approve
            })  # fmt: skip
            run(project, f"http://127.0.0.1:{http_port}", gateway, server, engine, started)
        except BaseException:
            project.print_logs()
            for log in (tmp_path / f"{REMOTE}.log", tmp_path / "podman" / "podman.log"):
                if log.exists():
                    print(f"--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}")
            raise
        finally:
            project.destroy()
            _phase(started, "torn down")


def run(
    project: Project, url: str, gateway: str, server: Path, engine: str, started: float
) -> None:
    project.compose("up", "-d", "--no-build")
    wait_for(lambda: healthy(url), 240, "the master's /healthz")
    _phase(started, "master up")
    key = project.exec("web", "python", "manage.py", "shell", "-c", MAKE_KEY).split()[-1]
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    local = project.node
    reach(api, f"/api/nodes/{local}", "Online", 120)
    # The bootstrap volume belongs to the master's user: migrate made it 0700 there when
    # it wrote the bundle the agent enrolled with.
    owner = project.exec("web", "stat", "-c", "%U %a", "/run/mirbad-bootstrap").split()
    assert owner == ["mirbad", "700"], owner

    # llama-server as a process of the compose's agent, from the mounted build.
    created = api.post("/api/models", json={**TINY, "node": local})
    assert created.status_code == 201, created.text
    process_model = created.json()["id"]
    assert api.post(f"/api/models/{process_model}/start").status_code == 202
    reach(api, f"/api/models/{process_model}", "Ready", 120)
    answer = chat(url, key, "tiny")
    assert answer.status_code == 200, answer.text

    # The same weights in an engine container, through the mounted Docker socket, on the
    # compose network (ModelsHostPath, DockerNetwork).
    boxed = api.post("/api/models", json={**TINY, "node": local, "servedName": "tiny-box",
                                          "delivery": "container", "image": engine})  # fmt: skip
    assert boxed.status_code == 201, boxed.text
    container_model = boxed.json()["id"]
    assert api.post(f"/api/models/{container_model}/start").status_code == 202
    reach(api, f"/api/models/{container_model}", "Ready", 120)
    answer = chat(url, key, "tiny-box")
    assert answer.status_code == 200, answer.text
    boxes = engines(project)
    assert boxes, "no engine container on the compose network"
    box_started = project.podman("inspect", "--format", "{{.State.StartedAt}}", boxes[0])
    _phase(started, "models answering")

    with outside_agent(api, project.folder, gateway, server):
        assert api.post(f"/api/nodes/{REMOTE}/approve").status_code == 200
        reach(api, f"/api/nodes/{REMOTE}", "Online", 120)
        _phase(started, "remote agent joined")

        project.compose("down", "-t", "15")
        assert not healthy(url)
        project.compose("up", "-d", "--no-build")
        wait_for(lambda: healthy(url), 240, "the master's /healthz after the restart")
        _phase(started, "master up again")
        # The same database, key and nodes; the process model started again (auto-start).
        for node in (local, REMOTE):
            reach(api, f"/api/nodes/{node}", "Online", 120)
        reach(api, f"/api/models/{process_model}", "Ready", 120)
        answer = chat(url, key, "tiny")
        assert answer.status_code == 200, answer.text
        # The engine container ran on through the restart: the new agent adopted it
        # (the same container, not started again) and the new monitor reads it Ready.
        reach(api, f"/api/models/{container_model}", "Ready", 120)
        assert engines(project) == boxes
        after = project.podman("inspect", "--format", "{{.State.StartedAt}}", boxes[0])
        assert after == box_started, (box_started, after)
        answer = chat(url, key, "tiny-box")
        assert answer.status_code == 200, answer.text
        assert api.post(f"/api/models/{container_model}/stop").status_code in (200, 202)
        reach(api, f"/api/models/{container_model}", "Stopped", 120)
        assert engines(project) == [], "the stopped engine's container is still there"
        _phase(started, "everything back after the restart")
