"""Fixtures for the agent tests: a test PKI, configs, a fake engine, a running agent.

The PKI is built with ``cryptography`` directly (never the master's code), so these tests
check the agent against the contract rather than against the master's implementation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_support import (
    FAKE_ENGINE_ENV,
    MASTER_URI,
    Pki,
    RunningAgent,
    client_context,
    issue,
    make_ca,
    make_fake_engine,
    make_identity,
    master_headers,
)
from cryptography.x509.oid import ExtendedKeyUsageOID

# The fake hub and download-manager fixtures, for the download and weights tests.
from download_support import bus, hub, make_manager, manager, tiny_gguf  # noqa: F401

from agent._config import AgentConfig, ExecutableEntry
from agent.http._server import AgentServer
from tests.parallel import engine_port_range


@pytest.fixture(scope="session")
def pki() -> Pki:
    ca = make_ca("Test CA")
    other = make_ca("Other CA")
    client_eku = [ExtendedKeyUsageOID.CLIENT_AUTH]
    return Pki(
        ca=ca,
        master=issue(ca, cn="master", uris=[MASTER_URI], eku=client_eku),
        other_ca=other,
        other_master=issue(other, cn="master", uris=[MASTER_URI], eku=client_eku),
    )


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def models_root(tmp_path: Path) -> Path:
    path = tmp_path / "models"
    (path / "demo").mkdir(parents=True)
    (path / "demo" / "demo.gguf").write_bytes(b"GGUF fake")
    return path


@pytest.fixture
def make_config(state_dir: Path, models_root: Path) -> Callable[..., AgentConfig]:
    def build(**overrides: Any) -> AgentConfig:
        base = AgentConfig(
            node_id="n1",
            state_directory=state_dir,
            models_root=models_root,
            port=0,
            port_range_start=engine_port_range()[0],
            port_range_end=engine_port_range()[1],
            health_check_interval_seconds=60,
            # Tests must not leave engines behind; the default (false) is tested explicitly.
            stop_instances_on_shutdown=True,
            engine_env_allow=FAKE_ENGINE_ENV,
        )
        return replace(base, **overrides)

    return build


@pytest.fixture
def fake_engine(tmp_path: Path) -> ExecutableEntry:
    """A verified executable folder whose llama-server is a small Python HTTP server."""
    return make_fake_engine(tmp_path)


@pytest.fixture
async def running_agent(
    pki: Pki, state_dir: Path, tmp_path: Path, make_config: Callable[..., AgentConfig], request: Any
) -> AsyncIterator[RunningAgent]:
    """An AgentServer on an ephemeral port and a master-authenticated client session.

    Parametrise indirectly with a dict of AgentConfig overrides if needed.
    """
    overrides = getattr(request, "param", {}) or {}
    config = make_config(**overrides)
    identity = make_identity(pki, state_dir)
    server = AgentServer(
        config=config,
        identity=identity,
        heartbeat_interval=0.3,
        ready_poll_interval=0.1,
        stop_grace_seconds=2.0,
    )
    await server.start()
    ctx = client_context(pki, pki.master, tmp_path / "client")
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=ctx), headers=master_headers()
    )
    try:
        yield RunningAgent(server=server, session=session, tmp=tmp_path, pki=pki)
    finally:
        await session.close()
        await server.stop()


@pytest.fixture(scope="session")
def llama_server_exe() -> Path:
    """The real llama-server of a laid-out folder, from MIRBAD_TEST_LLAMA_SERVER."""
    how = (
        "build one with `python -m agent install-llama-server --runtimes-dir DIR` and set "
        "MIRBAD_TEST_LLAMA_SERVER=DIR/llama.cpp/<version>/llama-server"
    )
    value = os.environ.get("MIRBAD_TEST_LLAMA_SERVER")
    if not value:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"MIRBAD_TEST_LLAMA_SERVER is not set in CI; {how}")
        print(f"\nSKIP: MIRBAD_TEST_LLAMA_SERVER is not set; {how}")
        pytest.skip(f"MIRBAD_TEST_LLAMA_SERVER is not set; {how}")
    path = Path(value)
    if not path.is_file() or not (path.parent / "manifest.json").is_file():
        pytest.fail(f"MIRBAD_TEST_LLAMA_SERVER={value} is not a laid-out llama-server; {how}")
    return path


@pytest.fixture
def mirbad_logging() -> Iterator[None]:
    """configure_logging replaces the ``mirbad`` logger's handlers: put them back after."""
    logger = logging.getLogger("mirbad")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        yield
    finally:
        for handler in logger.handlers:
            if handler not in saved[0]:
                handler.close()
        logger.handlers[:], logger.level, logger.propagate = saved
