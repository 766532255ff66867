"""The container runtime against a real Docker API: Podman's, on a socket of the test's own,
running the engine image built here from the test llama-server (tests/containers.py).

Launch, Ready, the proxy, the engine log, stop; every refusal before anything exists;
an engine that exits before Ready; adoption across an agent restart without a
restart of the container; a labelled container nobody describes removed, a foreign
one left alone; Docker gone: 503 docker_unavailable and the node's docker_unreachable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from container_support import agent_on, container_body

from agent._config import AgentConfig
from protocol.tinygguf import write_tiny_gguf
from tests.containers import engine_image, podman_socket

# Podman's store and container names are one per machine (tests/containers.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("podman_serial")]

NODE_LABEL = "io.mirbad.node"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory, llama_server_exe: Path) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("podman")
    with podman_socket(folder / "svc") as (sock, env):
        image = engine_image(llama_server_exe, env, folder / "image")
        client = docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
        try:
            yield {"socket": sock, "image": image, "client": client}
        finally:
            for c in client.containers.list(all=True, filters={"label": NODE_LABEL}):
                c.remove(force=True)
            client.close()


@pytest.fixture
def tiny_models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    write_tiny_gguf(root / "tiny" / "tiny.gguf")
    (root / "broken").mkdir()
    (root / "broken" / "broken.gguf").write_bytes(b"GGUF but not really")
    return root


@pytest.fixture
def container_config(
    make_config: Callable[..., AgentConfig], podman: dict, tiny_models: Path
) -> Callable[..., AgentConfig]:
    def build(**overrides: Any) -> AgentConfig:
        values: dict[str, Any] = {
            "models_root": tiny_models,
            "docker_enabled": True,
            "docker_endpoint": f"unix://{podman['socket']}",
            "allow_tag_pulls": True,
            "docker_call_timeout_seconds": 30.0,
            "docker_startup_timeout_seconds": 5.0,
            "process_start_timeout_seconds": 60.0,
        }
        values.update(overrides)
        return make_config(**values)

    return build


def ours(client: docker.DockerClient) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{NODE_LABEL}=n1"})


async def test_a_container_engine_starts_serves_logs_and_stops(
    podman: dict, container_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    client = podman["client"]
    async with agent_on(container_config(), pki, tmp_path) as agent:
        status, started = await agent.post("/agent/v1/instances", container_body(podman["image"]))
        assert status == 202, started
        assert started["state"] == "Starting" and started["delivery"] == "container"
        ready = await agent.wait_state("c-1", "Ready", "Failed")
        assert ready["state"] == "Ready", ready
        container = client.containers.get(ready["containerId"])
        labels = container.labels
        assert labels[NODE_LABEL] == "n1" and labels["io.mirbad.instance"] == "c-1"
        assert labels["io.mirbad.fingerprint"] == ready["fingerprint"]
        assert labels["io.mirbad.master-epoch"] == "1"
        mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
        assert set(mounts) == {"/models/tiny"} and mounts["/models/tiny"]["RW"] is False
        key = agent.server.runtime.get("c-1").key
        assert key not in " ".join(container.attrs["Config"]["Cmd"])
        assert f"LLAMA_API_KEY={key}" in container.attrs["Config"]["Env"]
        assert "/models/tiny/tiny.gguf" in container.attrs["Config"]["Cmd"]
        ports = container.attrs["HostConfig"]["PortBindings"]["8000/tcp"]
        assert ports == [{"HostIp": "127.0.0.1", "HostPort": str(ready["port"])}]
        # Through the agent's proxy, as the master's router sends /v1.
        async with agent.session.post(
            agent.url("/agent/v1/proxy/c-1/v1/chat/completions"),
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        ) as answer:
            assert answer.status == 200, await answer.text()
            assert (await answer.json())["choices"][0]["message"]["role"] == "assistant"
        # The engine's own output reaches the engine log the console reads.
        log_file = agent.server.config.state_directory / "logs" / "ss-c-1.log"
        for _ in range(50):
            if "llama" in log_file.read_text(errors="replace").split("starting container")[-1]:
                break
            await asyncio.sleep(0.1)
        assert "starting container ss-c-1" in log_file.read_text()
        assert "llama" in log_file.read_text(errors="replace").split("starting container")[-1]
        status, stopped = await agent.post("/agent/v1/instances/c-1/stop")
        assert status == 200 and stopped["state"] == "Stopped", stopped
        assert ours(client) == []


@pytest.mark.parametrize(
    ("change", "config", "message"),
    [
        (lambda b: b["container"]["mounts"][0].update(readOnly=False), {},
         "a writable models mount is refused"),
        (lambda b: b["container"].update(image="localhost/engine@" + DIGEST),
         {"approved_images": ("sha256:" + "cd" * 32,)}, "is not in this node's ApprovedImages"),
        (lambda b: b.update(args=[a if a != "{port}" else "8001" for a in b["args"]]), {},
         "'--port'"),
        (lambda b: None, {"allow_tag_pulls": False}, "names a tag"),
        (lambda b: b.update(args=[a if a != "0.0.0.0" else "127.0.0.1" for a in b["args"]]), {},
         "must be 0.0.0.0"),
        (lambda b: b.update(env={"LLAMA_API_KEY": "x"}), {}, "LLAMA_API_KEY"),
        (lambda b: b["container"]["mounts"].append(
            {"source": "cache", "target": "/cache", "readOnly": False}), {}, "CacheHostPath"),
        (lambda b: b.update(model={"folder": "missing", "file": "tiny.gguf"}), {},
         "does not exist"),
    ],
    ids=["writable-models", "unapproved-digest", "port-arg", "tag-not-allowed", "loopback-host",
         "key-in-env", "cache-without-volume", "missing-model"],
)  # fmt: skip
async def test_refusals_come_before_anything_is_created(
    podman: dict,
    container_config: Callable[..., AgentConfig],
    pki: Any,
    tmp_path: Path,
    change: Callable[[dict], None],
    config: dict,
    message: str,
) -> None:
    body = container_body(podman["image"])
    change(body)
    async with agent_on(container_config(**config), pki, tmp_path) as agent:
        status, answer = await agent.post("/agent/v1/instances", body)
        assert status == 422, answer
        assert answer["error"]["code"] == "spec_rejected"
        assert message in answer["error"]["message"], answer
        assert agent.server.runtime.list() == []
    assert ours(podman["client"]) == []


async def test_an_engine_that_exits_before_ready_is_failed_with_its_exit_code_and_log(
    podman: dict, container_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    body = container_body(podman["image"], model={"folder": "broken", "file": "broken.gguf"})
    async with agent_on(container_config(), pki, tmp_path) as agent:
        status, _ = await agent.post("/agent/v1/instances", body)
        assert status == 202
        failed = await agent.wait_state("c-1", "Failed", "Ready")
        assert failed["state"] == "Failed"
        assert failed["exitCode"] not in (None, 0), failed
        assert "before it was ready" in failed["error"]
        assert any("gguf" in line.lower() for line in failed["logTail"]), failed["logTail"]
        assert ours(podman["client"]) == []  # removed; its output stays in the engine log


async def test_an_agent_restart_adopts_the_running_container_without_restarting_it(
    podman: dict, container_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    client = podman["client"]
    config = container_config(stop_instances_on_shutdown=False)
    async with agent_on(config, pki, tmp_path) as agent:
        await agent.post("/agent/v1/instances", container_body(podman["image"]))
        first = await agent.wait_state("c-1", "Ready", "Failed")
        assert first["state"] == "Ready", first
    started_at = client.containers.get(first["containerId"]).attrs["State"]["StartedAt"]
    # Two more containers appear while no agent runs: one labelled as this node's that
    # no record describes, and a foreign one.
    stray = client.containers.create(
        podman["image"], command=["--version"], labels={NODE_LABEL: "n1"}, name="stray"
    )
    foreign = client.containers.create(
        podman["image"], command=["--version"], labels={"x": "y"}, name="foreign"
    )
    try:
        async with agent_on(config, pki, tmp_path / "again") as agent:
            again = await agent.wait_state("c-1", "Ready", "Failed", "Stopped")
            assert again["state"] == "Ready", again
            assert again["containerId"] == first["containerId"]
            assert again["port"] == first["port"]
            after = client.containers.get(first["containerId"]).attrs["State"]["StartedAt"]
            assert after == started_at  # adopted as it ran, not restarted
            ids = {c.id for c in client.containers.list(all=True)}
            assert stray.id not in ids and foreign.id in ids
            async with agent.session.post(
                agent.url("/agent/v1/proxy/c-1/v1/chat/completions"),
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            ) as answer:
                assert answer.status == 200  # the key survived the restart
            status, _ = await agent.post("/agent/v1/instances/c-1/stop")
            assert status == 200
    finally:
        foreign.remove(force=True)
    assert ours(client) == []


async def test_docker_gone_means_docker_unavailable_and_docker_unreachable(
    container_config: Callable[..., AgentConfig], podman: dict, pki: Any, tmp_path: Path
) -> None:
    config = container_config(
        docker_endpoint=f"unix://{tmp_path}/no-such.sock", docker_startup_timeout_seconds=0.0
    )
    async with agent_on(config, pki, tmp_path) as agent:
        status, answer = await agent.post("/agent/v1/instances", container_body(podman["image"]))
        assert status == 503, answer
        assert answer["error"]["code"] == "docker_unavailable"
        assert "does not answer" in answer["error"]["message"]
        await agent.server.health.refresh()
        codes = [r["code"] for r in agent.server.health.reasons]
        assert "docker_unreachable" in codes
        async with agent.session.get(agent.url("/agent/v1/info")) as info:
            features = (await info.json())["features"]
        assert "runtime.vllm.container" in features and "runtime.llamacpp.process" in features


async def test_stop_engines_stops_the_containers_a_dead_agent_left_running(
    podman: dict, container_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    from agent.engines import stop_recorded_containers

    client = podman["client"]
    config = container_config(stop_instances_on_shutdown=False)
    async with agent_on(config, pki, tmp_path) as agent:
        await agent.post("/agent/v1/instances", container_body(podman["image"]))
        ready = await agent.wait_state("c-1", "Ready", "Failed")
        assert ready["state"] == "Ready", ready
    # Labelled as this node's, but in no record: stop-engines leaves it to adoption.
    stray = client.containers.create(
        podman["image"], command=["--version"], labels={NODE_LABEL: "n1"}, name="stray2"
    )
    try:
        stopped = await asyncio.to_thread(stop_recorded_containers, config, grace=2)
        assert stopped == [ready["containerId"]]
        ids = {c.id for c in client.containers.list(all=True)}
        assert ready["containerId"] not in ids and stray.id in ids
    finally:
        stray.remove(force=True)


async def test_a_model_moved_from_process_to_container_keeps_its_instance_id(
    podman: dict,
    container_config: Callable[..., AgentConfig],
    pki: Any,
    tmp_path: Path,
    llama_server_exe: Path,
) -> None:
    from agent._config import ExecutableEntry

    exe = ExecutableEntry(
        name="llama.cpp", version="0.6.0-dev", path=llama_server_exe, default=True
    )
    process_body = container_body(podman["image"], delivery="process")
    del process_body["container"]
    process_body["args"] = [a if a != "0.0.0.0" else "127.0.0.1" for a in process_body["args"]]
    async with agent_on(container_config(executables=(exe,)), pki, tmp_path) as agent:
        status, _ = await agent.post("/agent/v1/instances", process_body)
        assert status == 202
        assert (await agent.wait_state("c-1", "Ready", "Failed"))["state"] == "Ready"
        # While it runs as a process, a container launch of the same id is refused.
        status, answer = await agent.post("/agent/v1/instances", container_body(podman["image"]))
        assert status == 409 and "runs as a process" in answer["error"]["message"], answer
        status, _ = await agent.post("/agent/v1/instances/c-1/stop")
        assert status == 200
        status, answer = await agent.post("/agent/v1/instances", container_body(podman["image"]))
        assert status == 202, answer
        ready = await agent.wait_state("c-1", "Ready", "Failed")
        assert ready["state"] == "Ready" and ready["delivery"] == "container", ready
        assert [i["instanceId"] for i in agent.server.runtime.list()] == ["c-1"]
        status, _ = await agent.post("/agent/v1/instances/c-1/stop")
        assert status == 200


async def test_an_exit_after_ready_restarts_the_container_within_the_budget(
    podman: dict, container_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    client = podman["client"]
    config = container_config(restart_budget=1)
    async with agent_on(config, pki, tmp_path) as agent:
        agent.server.runtime.container._watch = 0.2  # see the exits at once
        await agent.post("/agent/v1/instances", container_body(podman["image"]))
        first = await agent.wait_state("c-1", "Ready", "Failed")
        assert first["state"] == "Ready", first
        client.containers.get(first["containerId"]).kill()
        for _ in range(100):
            again = await agent.instance("c-1")
            if again["restartCount"] == 1 and again["state"] == "Ready":
                break
            await asyncio.sleep(0.2)
        assert again["state"] == "Ready" and again["restartCount"] == 1, again
        assert again["containerId"] == first["containerId"]  # the same container, started again
        # The budget (1 in the window) is spent: the next exit is Failed, with the code.
        client.containers.get(first["containerId"]).kill()
        failed = await agent.wait_state("c-1", "Failed", timeout=30)
        assert "RestartBudget" in failed["error"] and failed["exitCode"] not in (None, 0), failed
    assert ours(client) == []
