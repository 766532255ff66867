"""GET /agent/v1/images against a real Docker API: Podman's, on a socket of the test's own,
holding the engine image built here from the test llama-server (tests/containers.py).

The engine image listed with its tags, digests, size and creation time; the list's
order, its cap and both forms of ``Created`` (a fake engine); DockerEnabled false is
501 not_supported, Docker gone 503 docker_unavailable, and only the master may ask.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import docker
import pytest
from agent_support import Pki, RunningAgent, client_context, make_identity

from agent._config import AgentConfig
from agent.engines.container import _images
from agent.http._server import AgentServer
from tests.containers import engine_image, podman_socket

# Podman's store and container names are one per machine (tests/containers.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("podman_serial")]

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
ALIAS = ("localhost/mirbad-test-images", "alias")


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory, llama_server_exe: Path) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("podman")
    with podman_socket(folder / "svc") as (sock, env):
        image = engine_image(llama_server_exe, env, folder / "image")
        client = docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
        try:
            yield {"socket": sock, "image": image, "client": client}
        finally:
            client.close()


@contextlib.asynccontextmanager
async def agent_on(config: AgentConfig, pki: Pki, tmp: Path) -> AsyncIterator[RunningAgent]:
    """An agent and a master session without fencing headers: a read needs none."""
    server = AgentServer(config=config, identity=make_identity(pki, config.state_directory))
    await server.start()
    ctx = client_context(pki, pki.master, tmp / "client")
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
    try:
        yield RunningAgent(server=server, session=session, tmp=tmp, pki=pki)
    finally:
        await session.close()
        await server.stop()


async def get(agent: RunningAgent, path: str = "/agent/v1/images") -> tuple[int, Any]:
    async with agent.session.get(agent.url(path)) as resp:
        return resp.status, await resp.json()


def docker_config(
    make_config: Callable[..., AgentConfig], endpoint: str, **overrides: Any
) -> AgentConfig:
    values: dict[str, Any] = {
        "docker_enabled": True,
        "docker_endpoint": endpoint,
        "docker_call_timeout_seconds": 30.0,
        "docker_startup_timeout_seconds": 0.0,
    }
    return make_config(**values | overrides)


async def test_the_engine_image_is_listed_with_its_tags_and_size(
    podman: dict, make_config: Callable[..., AgentConfig], pki: Pki, tmp_path: Path
) -> None:
    client = podman["client"]
    held = client.images.get(podman["image"])
    held.tag(*ALIAS)
    try:
        config = docker_config(make_config, f"unix://{podman['socket']}")
        async with agent_on(config, pki, tmp_path) as agent:
            status, body = await get(agent)
    finally:
        client.images.remove(":".join(ALIAS))  # the tag only: the image stays
    assert status == 200, body
    assert body["truncated"] is False
    (image,) = [i for i in body["images"] if podman["image"] in i["tags"]]
    assert image["id"] == held.id and image["id"].startswith("sha256:")
    assert image["tags"] == sorted([podman["image"], ":".join(ALIAS)])
    assert image["sizeBytes"] == held.attrs["Size"] > 0
    assert isinstance(image["digests"], list)
    assert ISO.match(image["createdAt"]), image["createdAt"]
    assert set(image) == {"id", "tags", "digests", "sizeBytes", "createdAt"}
    order = [(not i["tags"], i["tags"][:1], i["id"]) for i in body["images"]]
    assert order == sorted(order)


class FakeGateway:
    """A DockerGateway whose engine answers ``summaries`` to GET /images/json."""

    def __init__(self, summaries: list[Any]) -> None:
        self.client = self
        self.api = self
        self._summaries = summaries

    def images(self) -> list[Any]:
        return self._summaries

    async def call(self, fn: Callable[[], Any]) -> Any:
        return fn()


async def test_order_cap_and_both_forms_of_created(monkeypatch: pytest.MonkeyPatch) -> None:
    summaries = [
        # Podman may say an RFC 3339 time with nanoseconds and an offset...
        {"Id": "sha256:b", "RepoTags": ["z/one:1", "a/one:1"], "RepoDigests": None,
         "Size": 10, "Created": "2026-12-01T10:00:00.123456789+02:00"},
        # ...Docker's list says seconds, and an older Docker "<none>" names.
        {"Id": "sha256:a", "RepoTags": ["<none>:<none>"], "RepoDigests": ["<none>@<none>"],
         "Size": 20, "Created": 1796112000},
        {"Id": "sha256:c", "RepoTags": ["m/two:2"], "RepoDigests": ["m/two@sha256:ff"],
         "Size": 30, "Created": "0001-01-01T00:00:00Z"},
        "not an image",
    ]  # fmt: skip
    gateway: Any = FakeGateway(summaries)
    listed = await _images.list_images(gateway)
    assert listed == {
        "images": [
            {"id": "sha256:b", "tags": ["a/one:1", "z/one:1"], "digests": [],
             "sizeBytes": 10, "createdAt": "2026-12-01T08:00:00.123Z"},
            {"id": "sha256:c", "tags": ["m/two:2"], "digests": ["m/two@sha256:ff"],
             "sizeBytes": 30, "createdAt": None},
            {"id": "sha256:a", "tags": [], "digests": [],
             "sizeBytes": 20, "createdAt": "2026-12-01T08:00:00.000Z"},
        ],
        "truncated": False,
    }  # fmt: skip
    monkeypatch.setattr(_images, "IMAGES_LIMIT", 2)
    capped = await _images.list_images(gateway)
    assert [i["id"] for i in capped["images"]] == ["sha256:b", "sha256:c"]
    assert capped["truncated"] is True


async def test_without_docker_enabled_it_is_not_supported(running_agent: RunningAgent) -> None:
    status, body = await get(running_agent)
    assert status == 501, body
    assert body["error"]["code"] == "not_supported"
    assert "does not run containers" in body["error"]["message"]
    assert "DockerEnabled is false" in body["error"]["message"]


async def test_docker_gone_is_docker_unavailable(
    make_config: Callable[..., AgentConfig], pki: Pki, tmp_path: Path
) -> None:
    config = docker_config(make_config, f"unix://{tmp_path}/no-such.sock")
    async with agent_on(config, pki, tmp_path) as agent:
        status, body = await get(agent)
    assert status == 503, body
    assert body["error"]["code"] == "docker_unavailable"
    assert "does not answer" in body["error"]["message"]


async def test_only_the_master_lists_images(running_agent: RunningAgent, pki: Pki) -> None:
    ctx = client_context(pki, pki.node("n3"), running_agent.tmp / "n3")
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session,
        session.get(running_agent.url("/agent/v1/images")) as resp,
    ):
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "client_not_master"
