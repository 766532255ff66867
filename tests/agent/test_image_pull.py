"""Image pulls against a registry of the test's own (tests/fakeregistry.py): the engine
image built here, exported from Podman's store and served over plain HTTP on
127.0.0.1, pulled by a Podman service that has a store of its own (so the image and its
layers are not there before the pull) and a registries.conf marking that registry
insecure (tests/containers.py).

A pull by tag, with ``image.pull`` progress on the event stream and on the instance,
then Ready and a completion; a pull by an approved digest; an unapproved digest refused
before the registry hears of it; a registry that cuts the layer: Failed, naming the
image, no container; a stop during a pull: nothing more is reported for it; and the
registry's own answers, in the shapes a pull reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from container_support import Agent, agent_on

from agent._config import AgentConfig
from protocol.tinygguf import write_tiny_gguf
from tests.containers import engine_image, podman_env, podman_socket
from tests.fakeregistry import BlobHooks, FakeRegistry, OciImage, export_oci_dir

# Podman's store and container names are one per machine (tests/containers.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("podman_serial")]

NODE_LABEL = "io.mirbad.node"
REPOSITORY = "mirbad/engine"
TAG = "v1"
PULL_KEYS = {"instanceId", "image", "status", "layers", "bytesDone", "bytesTotal"}


@pytest.fixture(scope="module")
def pulls(tmp_path_factory: pytest.TempPathFactory, llama_server_exe: Path) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("pulls")
    # Built (or found) in the shared store, then served by the registry from a copy.
    shared = folder / "shared"
    shared.mkdir()
    env = podman_env(shared)
    built = engine_image(llama_server_exe, env, folder / "image")
    image = OciImage.from_oci_dir(export_oci_dir(built, folder / "oci", env))
    with FakeRegistry() as registry:
        registry.push(REPOSITORY, TAG, image)
        # registries.conf is read when the service starts: the registry's port first.
        with podman_socket(folder / "svc", [registry.location]) as (sock, _env):
            client = docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
            try:
                yield {"socket": sock, "client": client, "registry": registry, "image": image}
            finally:
                client.close()


@pytest.fixture(autouse=True)
def fresh(pulls: dict) -> Iterator[None]:
    """Each test starts with an empty store and a registry that has served nothing."""
    client = pulls["client"]

    def empty() -> None:
        for c in client.containers.list(all=True):
            c.remove(force=True)
        for i in client.images.list(all=True):
            client.images.remove(i.id, force=True)

    empty()
    assert client.images.list(all=True) == []
    pulls["registry"].reset()
    yield
    empty()


def reference(registry: FakeRegistry, *, digest: str | None = None) -> str:
    name = f"{registry.location}/{REPOSITORY}"
    return f"{name}@{digest}" if digest else f"{name}:{TAG}"


def container_body(image: str, instance_id: str = "c-1") -> dict[str, Any]:
    return {
        "instanceId": instance_id,
        "modelId": 7,
        "servedName": "tiny",
        "runtime": "llamacpp",
        "delivery": "container",
        "executable": {"name": "llama.cpp", "version": None},
        "model": {"folder": "tiny", "file": "tiny.gguf"},
        "args": ["-m", "{model}", "--alias", "tiny", "--host", "0.0.0.0", "--port", "{port}",
                 "-c", "256", "-np", "1"],
        "env": {},
        "container": {
            "image": image,
            "mounts": [{"source": "models", "target": "/models", "readOnly": True}],
        },
    }  # fmt: skip


@pytest.fixture
def tiny_models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    write_tiny_gguf(root / "tiny" / "tiny.gguf")
    return root


@pytest.fixture
def pull_config(
    make_config: Callable[..., AgentConfig], pulls: dict, tiny_models: Path
) -> Callable[..., AgentConfig]:
    def build(**overrides: Any) -> AgentConfig:
        values: dict[str, Any] = {
            "models_root": tiny_models,
            "docker_enabled": True,
            "docker_endpoint": f"unix://{pulls['socket']}",
            "allow_tag_pulls": True,
            "docker_call_timeout_seconds": 30.0,
            "docker_startup_timeout_seconds": 5.0,
            "process_start_timeout_seconds": 60.0,
        }
        values.update(overrides)
        return make_config(**values)

    return build


@contextlib.asynccontextmanager
async def event_stream(agent: Agent) -> AsyncIterator[list[dict[str, Any]]]:
    """Every event of ``GET /agent/v1/events`` as it arrives (``event``, ``data``)."""
    seen: list[dict[str, Any]] = []
    async with agent.session.get(agent.url("/agent/v1/events")) as stream:
        assert stream.status == 200

        async def read() -> None:
            current: dict[str, Any] = {}
            async for raw in stream.content:
                line = raw.decode().rstrip("\n")
                if line:
                    name, _, value = line.partition(": ")
                    current[name] = json.loads(value) if name == "data" else value
                elif current:
                    seen.append(current)
                    current = {}

        reader = asyncio.create_task(read())
        # The stream's first event: from here on nothing published is missed.
        while not seen:
            await asyncio.sleep(0.02)
        try:
            yield seen
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


def pull_events(seen: list[dict[str, Any]], instance_id: str = "c-1") -> list[dict[str, Any]]:
    return [
        e["data"]
        for e in seen
        if e.get("event") == "image.pull" and e["data"]["instanceId"] == instance_id
    ]


def ours(client: docker.DockerClient) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{NODE_LABEL}=n1"})


async def complete(agent: Agent) -> None:
    async with agent.session.post(
        agent.url("/agent/v1/proxy/c-1/v1/chat/completions"),
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ) as answer:
        assert answer.status == 200, await answer.text()
        assert (await answer.json())["choices"][0]["message"]["role"] == "assistant"


def assert_whole_image_served(registry: FakeRegistry, image: OciImage, manifest: str) -> None:
    assert registry.served("manifest") == [f"/v2/{REPOSITORY}/manifests/{manifest}"]
    blobs = {p.rsplit("/", 1)[-1] for p in registry.served("blob")}
    assert blobs == {image.config_digest, *image.layer_digests}


async def test_a_pull_by_tag_reports_progress_then_the_engine_serves(
    pulls: dict, pull_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    registry, image, client = pulls["registry"], pulls["image"], pulls["client"]
    [layer] = image.layer_digests
    size = len(image.blobs[layer])
    # Podman reports a layer's bytes once a second: a pause mid-layer makes sure this
    # small one is caught downloading.
    registry.hook(layer, BlobHooks(delay_after=size // 2, delay_seconds=1.2))
    ref = reference(registry)
    async with agent_on(pull_config(), pki, tmp_path) as agent, event_stream(agent) as seen:
        status, started = await agent.post("/agent/v1/instances", container_body(ref))
        assert status == 202, started
        assert started["state"] == "Starting"
        waiting = await agent.instance("c-1")
        for _ in range(50):
            if waiting["pull"] is not None:
                break
            await asyncio.sleep(0.02)
            waiting = await agent.instance("c-1")
        assert waiting["state"] == "Starting" and waiting["pull"] is not None, waiting
        assert waiting["pull"]["image"] == ref and waiting["containerId"] is None
        ready = await agent.wait_state("c-1", "Ready", "Failed")
        assert ready["state"] == "Ready", ready
        assert ready["pull"] is None
        await complete(agent)
        events = pull_events(seen)
        status, _ = await agent.post("/agent/v1/instances/c-1/stop")
        assert status == 200
    assert all(set(e) == PULL_KEYS and e["image"] == ref for e in events), events
    assert events[0]["status"] == "started" and events[-1]["status"] == "done", events
    done = [e["bytesDone"] for e in events]
    assert done == sorted(done), events
    # Caught mid-layer, then the whole layer at the end.
    assert any(0 < e["bytesDone"] < e["bytesTotal"] == size for e in events), events
    assert events[-1]["layers"] == 1, events
    assert events[-1]["bytesDone"] == events[-1]["bytesTotal"] == size, events
    assert_whole_image_served(registry, image, TAG)
    assert ours(client) == []
    assert client.images.get(ref).id == image.config_digest


async def test_a_pull_by_an_approved_digest_without_tag_pulls(
    pulls: dict, pull_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    registry, image = pulls["registry"], pulls["image"]
    ref = reference(registry, digest=image.digest)
    config = pull_config(allow_tag_pulls=False, approved_images=(image.digest,))
    async with agent_on(config, pki, tmp_path) as agent, event_stream(agent) as seen:
        status, started = await agent.post("/agent/v1/instances", container_body(ref))
        assert status == 202, started
        ready = await agent.wait_state("c-1", "Ready", "Failed")
        assert ready["state"] == "Ready", ready
        await complete(agent)
        events = pull_events(seen)
        status, _ = await agent.post("/agent/v1/instances/c-1/stop")
        assert status == 200
    assert [e["status"] for e in events][:: len(events) - 1] == ["started", "done"], events
    assert_whole_image_served(registry, image, image.digest)
    assert ours(pulls["client"]) == []


async def test_an_unapproved_digest_is_refused_before_the_registry_hears_of_it(
    pulls: dict, pull_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    registry, image = pulls["registry"], pulls["image"]
    ref = reference(registry, digest=image.digest)
    config = pull_config(allow_tag_pulls=False, approved_images=("sha256:" + "cd" * 32,))
    async with agent_on(config, pki, tmp_path) as agent:
        status, answer = await agent.post("/agent/v1/instances", container_body(ref))
        assert status == 422, answer
        assert answer["error"]["code"] == "spec_rejected"
        assert image.digest in answer["error"]["message"]
        assert agent.server.runtime.list() == []
    assert registry.requests == []
    assert pulls["client"].images.list(all=True) == []


async def test_a_layer_cut_midway_fails_the_instance_naming_the_image(
    pulls: dict, pull_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    registry, image, client = pulls["registry"], pulls["image"], pulls["client"]
    [layer] = image.layer_digests
    registry.hook(layer, BlobHooks(cut_after=len(image.blobs[layer]) // 2))
    ref = reference(registry)
    async with agent_on(pull_config(), pki, tmp_path) as agent, event_stream(agent) as seen:
        status, _ = await agent.post("/agent/v1/instances", container_body(ref))
        assert status == 202
        failed = await agent.wait_state("c-1", "Failed", "Ready")
        events = pull_events(seen)
    assert f"image {ref} could not be pulled" in failed["error"], failed
    assert failed["containerId"] is None and failed["pull"] is None
    assert events[-1]["status"] == "failed", events
    assert ours(client) == [] and client.images.list(all=True) == []
    assert f"/v2/{REPOSITORY}/blobs/{layer}" in registry.served("blob")


async def test_a_stop_during_a_pull_ends_its_reports(
    pulls: dict, pull_config: Callable[..., AgentConfig], pki: Any, tmp_path: Path
) -> None:
    registry, image, client = pulls["registry"], pulls["image"], pulls["client"]
    [layer] = image.layer_digests
    registry.hook(layer, BlobHooks(delay_after=len(image.blobs[layer]) // 2, delay_seconds=1.5))
    ref = reference(registry)
    async with agent_on(pull_config(), pki, tmp_path) as agent, event_stream(agent) as seen:
        status, _ = await agent.post("/agent/v1/instances", container_body(ref))
        assert status == 202
        for _ in range(100):
            if registry.served("blob"):
                break
            await asyncio.sleep(0.02)
        status, stopped = await agent.post("/agent/v1/instances/c-1/stop")
        assert status == 200 and stopped["state"] == "Stopped", stopped
        stopped_at = len(seen)
        # The engine goes on with the pull the agent no longer waits for; once it has
        # the image, every report the pull could have made is made.
        for _ in range(100):
            if client.images.list():
                break
            await asyncio.sleep(0.05)
        assert client.images.list(), "the pull did not finish"
        await asyncio.sleep(0.5)
        after = await agent.instance("c-1")
        late = pull_events(seen[stopped_at:])
    assert after["state"] == "Stopped" and after["pull"] is None, after
    assert late == [], late
    assert ours(client) == []


def test_the_registry_answers_in_the_shapes_a_pull_reads(pulls: dict) -> None:
    registry, image = pulls["registry"], pulls["image"]
    base = f"http://127.0.0.1:{registry.port}/v2"

    def ask(method: str, path: str, accept: str | None = None) -> tuple[int, Any, bytes]:
        headers = {"Accept": accept} if accept else {}
        request = urllib.request.Request(base + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.status, answer.headers, answer.read()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.headers, refused.read()

    status, headers, body = ask("GET", "/")
    assert (status, body) == (200, b"{}")
    assert headers["Docker-Distribution-API-Version"] == "registry/2.0"
    for reference in (TAG, image.digest):
        status, headers, body = ask("HEAD", f"/{REPOSITORY}/manifests/{reference}")
        assert status == 200 and body == b""
        assert headers["Content-Type"] == image.media_type
        assert headers["Docker-Content-Digest"] == image.digest
        assert headers["Content-Length"] == str(len(image.manifest))
    status, headers, body = ask(
        "GET", f"/{REPOSITORY}/manifests/{TAG}", f"{image.media_type}, application/json"
    )
    assert status == 200 and body == image.manifest
    status, _, body = ask(
        "GET",
        f"/{REPOSITORY}/manifests/{TAG}",
        "application/vnd.docker.distribution.manifest.v1+json",
    )
    assert status == 404 and json.loads(body)["errors"][0]["code"] == "MANIFEST_UNKNOWN"
    [layer] = image.layer_digests
    status, headers, body = ask("GET", f"/{REPOSITORY}/blobs/{layer}")
    assert status == 200 and body == image.blobs[layer]
    assert headers["Docker-Content-Digest"] == layer
    assert headers["Content-Length"] == str(len(image.blobs[layer]))
    assert ask("GET", f"/{REPOSITORY}/blobs/sha256:{'0' * 64}")[0] == 404
    assert ask("GET", f"/other/manifests/{TAG}")[0] == 404
    kinds = [(r.method, r.kind, r.status) for r in registry.requests]
    assert kinds[:3] == [("GET", "base", 200), ("HEAD", "manifest", 200), ("HEAD", "manifest", 200)]
