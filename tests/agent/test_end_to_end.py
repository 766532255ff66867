"""Through the mTLS listener: launch, events, proxy (SSE), stop, delete; then the real engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from agent_support import (
    RunningAgent,
    client_context,
    launch_body,
    make_identity,
    master_headers,
)

from agent._config import AgentConfig, ExecutableEntry
from agent.http._server import AgentServer
from protocol.tinygguf import write_tiny_gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def start_agent(
    pki: Any, state_dir: Path, tmp_path: Path, config: AgentConfig
) -> RunningAgent:
    server = AgentServer(
        config=config,
        identity=make_identity(pki, state_dir),
        heartbeat_interval=1.0,
        ready_poll_interval=0.1,
        stop_grace_seconds=2.0,
    )
    await server.start()
    ctx = client_context(pki, pki.master, tmp_path / "client")
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=ctx), headers=master_headers()
    )
    return RunningAgent(server=server, session=session, tmp=tmp_path, pki=pki)


def llama_entry(llama_server_exe: Path, models_root: Path) -> ExecutableEntry:
    """The tiny GGUF written under models/tiny and the real llama-server as the node's
    default executable (its version from the build's manifest)."""
    write_tiny_gguf(models_root / "tiny" / "tiny.gguf")
    version = json.loads((llama_server_exe.parent / "manifest.json").read_text())["version"]
    return ExecutableEntry(name="llama.cpp", version=version, path=llama_server_exe, default=True)


async def launch_ready(agent: RunningAgent, instance_id: str = "m-1") -> dict[str, Any]:
    """Launch the fake engine's instance (agent_support.launch_body) and wait for Ready."""
    async with agent.session.post(
        agent.url("/agent/v1/instances"), json=launch_body(instance_id)
    ) as resp:
        assert resp.status == 202, await resp.text()
    return await wait_ready(agent, instance_id)


async def wait_ready(agent: RunningAgent, instance_id: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with agent.session.get(agent.url("/agent/v1/instances")) as resp:
            body = await resp.json()
        [inst] = [i for i in body["instances"] if i["instanceId"] == instance_id]
        if inst["state"] == "Ready":
            return inst
        assert inst["state"] == "Starting", inst
        await asyncio.sleep(0.1)
    raise AssertionError(f"{instance_id} was not Ready within {timeout} s")


async def test_fake_engine_through_the_agent(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
) -> None:
    agent = await start_agent(pki, state_dir, tmp_path, make_config(executables=(fake_engine,)))
    try:
        events = await agent.session.get(agent.url("/agent/v1/events"))
        release = tmp_path / "release"
        body = launch_body(env={"FAKE_RELEASE_FILE": str(release)})
        async with agent.session.post(agent.url("/agent/v1/instances"), json=body) as resp:
            assert resp.status == 202
            assert (await resp.json())["state"] == "Starting"
        async with agent.session.post(agent.url("/agent/v1/instances"), json=body) as resp:
            assert resp.status == 202, "re-posting the same spec is idempotent"
        await wait_ready(agent, "m-1")

        states = []
        while len(states) < 2:
            line = (await asyncio.wait_for(events.content.readline(), 5)).decode()
            if line.startswith("data: ") and '"servedName"' in line:
                states.append(json.loads(line[6:])["state"])
        assert states == ["Starting", "Ready"]
        events.close()

        proxy = agent.url("/agent/v1/proxy/m-1")
        wrong = {"Authorization": "Bearer not-the-key"}
        async with agent.session.get(proxy + "/v1/models", headers=wrong) as resp:
            assert resp.status == 200
            assert (await resp.json())["data"][0]["id"] == "demo"
        async with agent.session.post(proxy + "/echo?q=1", data=b"payload") as resp:
            echoed = await resp.json()
        assert echoed["path"] == "/echo?q=1" and echoed["body"] == "payload"

        async with agent.session.get(proxy + "/sse") as resp:
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert first == b"data: first\n\n"
            release.touch()
            assert await asyncio.wait_for(resp.content.read(), 5) == b"data: second\n\n"

        async with agent.session.post(agent.url("/agent/v1/instances/m-1/stop")) as resp:
            assert resp.status == 200
            assert (await resp.json())["state"] == "Stopped"
        async with agent.session.get(proxy + "/v1/models") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "model_not_running"
        async with agent.session.delete(agent.url("/agent/v1/instances/m-1")) as resp:
            assert resp.status == 204
        async with agent.session.get(agent.url("/agent/v1/instances")) as resp:
            assert (await resp.json()) == {"instances": []}
    finally:
        await agent.session.close()
        await agent.server.stop()


async def test_engines_survive_an_agent_stop_and_are_adopted(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
) -> None:
    """StopInstancesOnShutdown false: the engine outlives the agent; the next one adopts it."""
    config = make_config(executables=(fake_engine,), stop_instances_on_shutdown=False)
    agent = await start_agent(pki, state_dir, tmp_path, config)
    try:
        async with agent.session.post(agent.url("/agent/v1/instances"), json=launch_body()) as r:
            assert r.status == 202
        first = await wait_ready(agent, "m-1")
        key = agent.server.runtime.get("m-1").key
    finally:
        await agent.session.close()
        await agent.server.stop()
    pid = first["pid"]
    assert psutil.Process(pid).is_running(), "the engine must outlive the agent"
    record = json.loads((state_dir / "processes.json").read_text())["instances"][0]
    assert record["state"] == "Ready" and record["pid"] == pid
    assert record["pendingStart"] is False and record["argvDigest"].startswith("sha256:")
    again = await start_agent(pki, state_dir, tmp_path, make_config(executables=(fake_engine,)))
    try:
        adopted = await wait_ready(again, "m-1")
        assert adopted["pid"] == pid and adopted["port"] == first["port"]
        assert adopted["fingerprint"] == first["fingerprint"]
        assert again.server.runtime.get("m-1").key == key
        async with again.session.get(again.url("/agent/v1/status")) as resp:
            [listed] = (await resp.json())["instances"]
        assert listed["state"] == "Ready" and listed["pid"] == pid
        # The proxy still reaches it: the agent kept the key the engine was started with.
        async with again.session.get(again.url("/agent/v1/proxy/m-1/v1/models")) as resp:
            assert resp.status == 200
            assert (await resp.json())["data"][0]["id"] == "demo"
        async with again.session.post(again.url("/agent/v1/instances/m-1/stop")) as resp:
            assert resp.status == 200
            assert (await resp.json())["state"] == "Stopped"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    finally:
        await again.session.close()
        await again.server.stop()


async def test_real_llama_server_chat_completion(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    llama_server_exe: Path,
    models_root: Path,
) -> None:
    """A tiny GGUF through the runtime and a chat completion through the proxy."""
    exe = llama_entry(llama_server_exe, models_root)
    agent = await start_agent(pki, state_dir, tmp_path, make_config(executables=(exe,)))
    try:
        async with agent.session.get(agent.url("/agent/v1/info")) as resp:
            [info] = (await resp.json())["executables"]
        assert info == {
            "name": "llama.cpp",
            "version": exe.version,
            "default": True,
            "verified": True,
        }
        args = [
            "-m", "{model}", "--alias", "tiny", "-c", "1024", "-np", "1", "-ngl", "0",
            "--host", "127.0.0.1", "--port", "{port}", "--metrics", "--no-ui",
            "--cache-ram", "0", "--fit", "off",
        ]  # fmt: skip
        body = launch_body(
            "tiny-1", servedName="tiny", model={"folder": "tiny", "file": "tiny.gguf"}, args=args
        )
        async with agent.session.post(agent.url("/agent/v1/instances"), json=body) as resp:
            assert resp.status == 202, await resp.text()
        await wait_ready(agent, "tiny-1", timeout=60)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        url = agent.url("/agent/v1/proxy/tiny-1/v1/chat/completions")
        async with agent.session.post(url, json=chat) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] > 0
        # Streaming comes back as SSE chunks.
        async with agent.session.post(url, json={**chat, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = (await resp.read()).decode()
        assert text.count("data: ") >= 2 and "[DONE]" in text
        async with agent.session.get(agent.url("/agent/v1/proxy/tiny-1/metrics")) as resp:
            assert resp.status == 200
            assert "llamacpp:" in await resp.text()
    finally:
        await agent.session.close()
        await agent.server.stop()
