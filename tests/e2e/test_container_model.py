"""A container model through the master, on real processes (issue 16).

A real `mirbad up` stack whose local agent has DockerEnabled and Podman's Docker API
(a socket of the test's own, tests/containers.py) runs the tiny model in the engine
image built here from the test llama-server: defined with delivery `container`
through /api, started, Ready, answering /v1 through the agent's proxy, its engine
log read by the master's own client; the agent killed -9 while the container runs
and adopted by the agent the launcher restarts (same container id, no restart);
stopped and removed. An unapproved digest is refused 422 spec_rejected by the
agent before anything exists; with the Docker socket gone the node is Degraded
docker_unreachable and a start is 503 docker_unavailable.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.containers import engine_image, podman_socket
from tests.e2e.conftest import ROOT, llama_server_or_fail, wait_for

# Podman's store and container names are one per machine (tests/containers.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("podman_serial")]

NODE_LABEL = "io.mirbad.node"
OTHER_DIGEST = "sha256:" + "cd" * 32


def model_state(api: httpx.Client, model_id: int) -> str:
    return str(api.get(f"/api/models/{model_id}").json()["state"])


def instance(api: httpx.Client, model_id: int) -> dict[str, Any] | None:
    node = api.get("/api/nodes/local").json()
    return next((i for i in node["instances"] if i.get("modelId") == model_id), None)


def engine_log(stack: Any, instance_id: str) -> list[str]:
    """The engine's log as the console reads it: the master's client, the agent's /logs."""
    script = (
        "import asyncio, django, json\n"
        "django.setup()\n"
        "from nodes.models import Node\n"
        "from nodes.agent_client import AsyncAgentClient\n"
        "node = Node.objects.get(node_id='local')\n"
        "async def main():\n"
        "    client = AsyncAgentClient(node=node)\n"
        f"    answer = await client.log_lines({instance_id!r}, limit=200)\n"
        "    print(json.dumps(answer['lines']))\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**stack.env, "DJANGO_SETTINGS_MODULE": "mirbad_site.settings"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = json.loads(done.stdout.strip().splitlines()[-1])
    return [line["text"] if isinstance(line, dict) else str(line) for line in lines]


def test_a_container_model_through_the_master(make_stack, tmp_path: Path) -> None:
    import docker
    import docker.errors

    server = llama_server_or_fail()
    with podman_socket(tmp_path / "podman") as (sock, podman_env):
        image = engine_image(server, podman_env, tmp_path / "image")
        client = docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
        stack = make_stack(embedded=True)
        stack.prepare_local_model()
        stack.env.update(
            {
                "MIRBAD_AGENT_DOCKER_ENABLED": "true",
                "MIRBAD_AGENT_DOCKER_ENDPOINT": f"unix://{sock}",
                "MIRBAD_AGENT_ALLOW_TAG_PULLS": "true",
                # Tags run here (AllowTagPulls); a digest must be this one.
                "MIRBAD_AGENT_APPROVED_IMAGES": json.dumps([OTHER_DIGEST]),
                "MIRBAD_AGENT_DOCKER_STARTUP_TIMEOUT_SECONDS": "5",
            }
        )
        try:
            facts = stack.start()
            api = stack.api(facts["API key"], timeout=60)
            run(stack, api, client, image, facts["API key"], podman_sock=sock)
        except BaseException:
            stack.print_logs()
            raise
        finally:
            # The test ends with the engine killed: nothing is left to list then.
            with contextlib.suppress(docker.errors.DockerException, OSError):
                for c in client.containers.list(all=True, filters={"label": NODE_LABEL}):
                    c.remove(force=True)
            client.close()


def run(
    stack: Any, api: httpx.Client, client: Any, image: str, key: str, *, podman_sock: Path
) -> None:
    wait_for(
        lambda: (
            "runtime.llamacpp.container"
            in (api.get("/api/nodes/local").json().get("facts") or {}).get("features", [])
            or api.get("/api/nodes/local").json()["state"] == "Online"
        ),
        60,
        "the local node Online",
    )
    # A container model, defined as an operator would.
    created = api.post(
        "/api/models",
        json={
            "servedName": "tiny-box",
            "runtime": "llamacpp",
            "delivery": "container",
            "image": image,
            "sourceFolder": "tiny",
            "sourceFile": "tiny.gguf",
            "settings": {"context_size": 256, "gpu_layers": 0, "parallel": 1},
            "node": "local",
        },
    )
    assert created.status_code == 201, created.text
    model = created.json()
    assert (model["delivery"], model["image"]) == ("container", image)
    model_id = model["id"]
    # The master refuses a port in extra args before anything reaches a node.
    refused = api.patch(
        f"/api/models/{model_id}", json={"settings": {"extra_args": ["--port", "9000"]}}
    )
    assert refused.status_code == 400, refused.text

    started = api.post(f"/api/models/{model_id}/start")
    assert started.status_code == 202, started.text
    wait_for(lambda: model_state(api, model_id) == "Ready", 120, "the container model Ready")
    first = instance(api, model_id)
    assert first is not None and first.get("containerId"), first
    container = client.containers.get(first["containerId"])
    assert container.labels["io.mirbad.instance"] == first["instanceId"]
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert mounts["/models/tiny"]["RW"] is False

    # /v1 through the master's router and the agent's proxy into the container.
    chat = {"model": "tiny-box", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    v1 = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    answer = v1.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"

    # The engine's own output, as the console's log panel reads it.
    lines = wait_for(
        lambda: [t for t in engine_log(stack, first["instanceId"]) if "llama" in t.lower()],
        30,
        "llama-server's lines in the engine log",
    )
    assert lines

    # kill -9 of the agent while the container runs: the launcher starts a new agent,
    # which adopts the container as it runs.
    started_at = container.attrs["State"]["StartedAt"]
    old_pid = stack.pid("agent")
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: stack.pid("agent") != old_pid, 60, "a new agent started by the launcher")

    def adopted() -> bool:
        inst = instance(api, model_id) or {}
        return inst.get("state") == "Ready" and inst.get("containerId") == first["containerId"]

    # /v1 answers again once the new agent listens and has adopted the container (a
    # 503 node_unreachable while it starts is the router telling the truth).
    wait_for(
        lambda: v1.post("/v1/chat/completions", json=chat).status_code == 200,
        90,
        "/v1 through the restarted agent",
    )
    wait_for(adopted, 30, "the container adopted by the restarted agent")
    assert client.containers.get(first["containerId"]).attrs["State"]["StartedAt"] == started_at
    agent_log = (stack.data / "logs" / "agent.log").read_text(errors="replace")
    assert f"Adopting container {first['containerId'][:12]}" in agent_log

    # Stop: the container is removed.
    stopped = api.post(f"/api/models/{model_id}/stop")
    assert stopped.status_code in (200, 202), stopped.text
    wait_for(lambda: model_state(api, model_id) == "Stopped", 60, "the model Stopped")
    assert client.containers.list(all=True, filters={"label": f"{NODE_LABEL}=local"}) == []

    # An image by a digest this node does not approve: the agent refuses it (422)
    # before any container exists.
    digest_image = image.split(":")[0] + "@sha256:" + "ab" * 32
    changed = api.patch(f"/api/models/{model_id}", json={"image": digest_image})
    assert changed.status_code == 200, changed.text
    refused = api.post(f"/api/models/{model_id}/start")
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "spec_rejected"
    assert "ApprovedImages" in refused.json()["error"]["message"]
    assert client.containers.list(all=True, filters={"label": f"{NODE_LABEL}=local"}) == []
    api.patch(f"/api/models/{model_id}", json={"image": image})

    # The Docker engine gone (its service killed): Degraded docker_unreachable, and a
    # start answered 503 docker_unavailable before anything is recorded.
    service = next(
        p for p in psutil.process_iter(["cmdline"])
        if "service" in (p.info["cmdline"] or []) and f"unix://{podman_sock}" in (p.info["cmdline"] or [])
    )  # fmt: skip
    service.kill()
    service.wait(10)

    def degraded() -> bool:
        node = api.get("/api/nodes/local").json()
        codes = [r.get("code") for r in node.get("reasons") or []]
        return node["state"] == "Degraded" and "docker_unreachable" in codes

    wait_for(degraded, 60, "the node Degraded docker_unreachable")
    refused = api.post(f"/api/models/{model_id}/start")
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "docker_unavailable"
    assert model_state(api, model_id) == "Stopped"
