"""A launch posted straight to the agent, bypassing the master's builder (issue 11).

The agent has an engine configured here, so a spec it accepted would start; every
refusal must be 422 spec_rejected naming the flag, with nothing started.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_support import (
    RunningAgent,
    client_context,
    launch_body,
    make_identity,
    master_headers,
)

from agent._config import AgentConfig, ExecutableEntry
from agent.engines._executables import write_manifest
from agent.http._server import AgentServer
from protocol.engine_flags import ENGINE_FLAG_TABLES, EngineFlags, engine_flags
from protocol.tinygguf import write_tiny_gguf
from tests.engine_flag_attacks import BYPASSES, ISSUE_ATTACKS, MCP_JSON
from tests.parallel import free_port

pytestmark = pytest.mark.timeout(30)

BUILDER_ARGS = launch_body()["args"]


@pytest.fixture
async def start_agent(
    pki: Any, state_dir: Path, tmp_path: Path, make_config: Callable[..., AgentConfig]
) -> AsyncIterator[Callable[..., Any]]:
    """Starts an agent with the given executables; stops it at the end."""
    started: list[RunningAgent] = []

    async def start(*executables: ExecutableEntry) -> RunningAgent:
        server = AgentServer(
            config=make_config(executables=executables),
            identity=make_identity(pki, state_dir),
            heartbeat_interval=0.3,
            ready_poll_interval=0.1,
            stop_grace_seconds=2.0,
        )
        await server.start()
        ctx = client_context(pki, pki.master, tmp_path / "client")
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx), headers=master_headers()
        )
        started.append(RunningAgent(server=server, session=session, tmp=tmp_path, pki=pki))
        return started[-1]

    try:
        yield start
    finally:
        for agent in started:
            await agent.session.close()
            await agent.server.stop()


@pytest.fixture
async def agent_with_engine(
    start_agent: Callable[..., Any], fake_engine: ExecutableEntry
) -> RunningAgent:
    """An agent whose default llama.cpp is the fake engine (it would start a spec)."""
    return await start_agent(fake_engine)


async def launch(agent: RunningAgent, body: dict[str, Any]) -> tuple[int, Any]:
    async with agent.session.post(agent.url("/agent/v1/instances"), json=body) as resp:
        return resp.status, await resp.json()


async def instances(agent: RunningAgent) -> list[Any]:
    async with agent.session.get(agent.url("/agent/v1/instances")) as resp:
        return (await resp.json())["instances"]


@pytest.mark.parametrize(("extra", "flag"), ISSUE_ATTACKS + BYPASSES)
async def test_launch_with_a_flag_off_the_allow_list_is_refused(
    agent_with_engine: RunningAgent, extra: list[str], flag: str
) -> None:
    body = launch_body(args=[*BUILDER_ARGS, *extra])
    status, answer = await launch(agent_with_engine, body)
    assert status == 422, answer
    assert answer["error"]["code"] == "spec_rejected"
    assert flag in answer["error"]["message"]
    assert answer["error"]["details"] == {"flag": flag}
    assert await instances(agent_with_engine) == []  # nothing was started


async def test_chat_template_outside_the_engine_list_is_refused(
    agent_with_engine: RunningAgent,
) -> None:
    body = launch_body(args=[*BUILDER_ARGS, "--chat-template", "../../etc"])
    status, answer = await launch(agent_with_engine, body)
    assert status == 422 and answer["error"]["details"] == {"flag": "--chat-template"}
    assert "built-in templates" in answer["error"]["message"]


async def test_allowed_flags_still_start(agent_with_engine: RunningAgent) -> None:
    body = launch_body(args=[*BUILDER_ARGS, "--temp", "0.2", "--jinja", "-c", "1024"])
    status, answer = await launch(agent_with_engine, body)
    assert status == 202, answer
    assert [i["instanceId"] for i in await instances(agent_with_engine)] == ["m-1"]


async def test_the_resolved_default_version_has_its_own_allow_list(
    start_agent: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_engine: ExecutableEntry,
) -> None:
    """A spec naming no version is checked again against the node default's allow-list."""
    newest = engine_flags("llamacpp")
    older = EngineFlags(
        engine="llamacpp",
        label="llama.cpp 0.5",
        first=(0, 5),
        last=(0, 5),
        flags=tuple(f for f in newest.flags if "--temp" not in f.names),
        chat_templates=newest.chat_templates,
    )
    monkeypatch.setattr("protocol.engine_flags.ENGINE_FLAG_TABLES", (*ENGINE_FLAG_TABLES, older))
    folder = tmp_path / "runtimes" / "llama.cpp" / "0.5.1"
    folder.mkdir(parents=True)
    script = folder / "llama-server"
    script.write_bytes(fake_engine.path.read_bytes())
    script.chmod(0o755)
    write_manifest(folder, name="llama.cpp", version="0.5.1")
    agent = await start_agent(
        ExecutableEntry(name="llama.cpp", version="0.5.1", path=script, default=True)
    )
    body = launch_body(args=[*BUILDER_ARGS, "--temp", "0.2"])
    assert body["executable"]["version"] is None  # the node's default: 0.5.1
    status, answer = await launch(agent, body)
    assert status == 422, answer
    assert answer["error"]["details"] == {"flag": "--temp"}
    assert "not an allowed llama.cpp 0.5 flag" in answer["error"]["message"]
    assert await instances(agent) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_mcp_spec_is_refused_and_the_real_engine_would_have_run_it(
    start_agent: Callable[..., Any], llama_server_exe: Path, models_root: Path, tmp_path: Path
) -> None:
    """Issue 11 end to end: the real llama-server runs the MCP command; the agent refuses it.

    First llama-server itself, given the issue's argv, creates PWNED (so the check for
    the file below can see an attack that got through); then the same argv posted to
    an agent running that engine is 422 and no PWNED appears anywhere.
    """
    write_tiny_gguf(models_root / "tiny" / "tiny.gguf")
    attack = ["--mcp-servers-json", MCP_JSON]
    control = tmp_path / "control"
    control.mkdir()
    engine = await asyncio.create_subprocess_exec(
        str(llama_server_exe), "-m", str(models_root / "tiny" / "tiny.gguf"),
        "--host", "127.0.0.1", "--port", str(free_port()), "-c", "256", "-ngl", "0",
        "--no-ui", *attack,
        cwd=control, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (control / "PWNED").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert (control / "PWNED").exists(), "llama-server did not run the MCP command"
    finally:
        engine.kill()
        await engine.wait()

    version = json.loads((llama_server_exe.parent / "manifest.json").read_text())["version"]
    agent = await start_agent(
        ExecutableEntry(name="llama.cpp", version=version, path=llama_server_exe, default=True)
    )
    args = [
        "-m", "{model}", "--alias", "tiny", "-c", "256", "-ngl", "0",
        "--host", "127.0.0.1", "--port", "{port}", "--no-ui", *attack,
    ]  # fmt: skip
    body = launch_body(servedName="tiny", model={"folder": "tiny", "file": "tiny.gguf"}, args=args)
    status, answer = await launch(agent, body)
    assert status == 422, answer
    assert answer["error"]["details"] == {"flag": "--mcp-servers-json"}
    await asyncio.sleep(2)  # an engine started anyway would have spawned by now
    assert await instances(agent) == []
    assert [p for p in tmp_path.rglob("PWNED") if control not in p.parents] == []
