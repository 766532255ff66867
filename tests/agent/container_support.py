"""What the container tests share: an agent on a Docker API with a master's session,
and a container launch body for the tiny model (tests/agent/test_container_runtime.py,
test_image_pull.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from agent_support import client_context, make_identity, master_headers

from agent._config import AgentConfig
from agent.http._server import AgentServer


def container_body(image: str, instance_id: str = "c-1", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "instanceId": instance_id,
        "modelId": 7,
        "servedName": "tiny",
        "runtime": "llamacpp",
        "delivery": "container",
        "executable": {"name": "llama.cpp", "version": None},
        "model": {"folder": "tiny", "file": "tiny.gguf"},
        "args": ["-m", "{model}", "--alias", "tiny", "--host", "0.0.0.0", "--port", "{port}",
                 "-c", "256", "-np", "1", "--metrics"],
        "env": {},
        "container": {
            "image": image,
            "mounts": [{"source": "models", "target": "/models", "readOnly": True}],
        },
    }  # fmt: skip
    body.update(overrides)
    return body


class Agent:
    def __init__(self, server: AgentServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.server.port}{path}"

    async def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.session.post(self.url(path), json=body, headers=master_headers()) as r:
            return r.status, await r.json(content_type=None)

    async def instance(self, instance_id: str) -> dict[str, Any]:
        async with self.session.get(self.url("/agent/v1/instances")) as r:
            items = (await r.json())["instances"]
        return next(i for i in items if i["instanceId"] == instance_id)

    async def wait_state(self, instance_id: str, *states: str, timeout: float = 90) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            item = await self.instance(instance_id)
            if item["state"] in states:
                return item
            assert loop.time() < deadline, item
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def agent_on(config: AgentConfig, pki: Any, tmp: Path) -> AsyncIterator[Agent]:
    identity = make_identity(pki, config.state_directory)
    server = AgentServer(
        config=config,
        identity=identity,
        heartbeat_interval=0.3,
        ready_poll_interval=0.2,
        stop_grace_seconds=2.0,
    )
    await server.start()
    ctx = client_context(pki, pki.master, tmp / "client")
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
    try:
        yield Agent(server, session)
    finally:
        await session.close()
        await server.stop()
