"""Fixtures for node tests: an agent enrolled through the master's own services."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from agent import AgentConfig, AgentServer
from agent._config import ExecutableEntry
from agent.identity._tls import generate_key_and_csr, load_identity, store_identity
from nodes import services
from nodes.models import Node


@dataclass
class Enrolled:
    node: Node
    server: AgentServer


def _enroll(state_dir: Path) -> Node:
    token = services.create_token(node_id="n1", purpose="join", lifetime=dt.timedelta(hours=1))
    key, csr = generate_key_and_csr("n1")
    answer = services.enroll(token=token, node_id="n1", csr_pem=csr.decode(), addresses=[])
    store_identity(
        state_dir, key=key, cert_pem=answer["certPem"].encode(), ca_pem=answer["caCertPem"].encode()
    )
    Node.objects.filter(node_id="n1").update(approved=True)
    return Node.objects.get(node_id="n1")


@contextlib.asynccontextmanager
async def start_enrolled(
    tmp_path: Path, *, executables: tuple[ExecutableEntry, ...] = (), **server: Any
) -> AsyncIterator[Enrolled]:
    """Node n1 enrolled through the master's services, its agent serving on a free port."""
    state = tmp_path / "state"
    node = await sync_to_async(_enroll)(state)
    config = AgentConfig(
        node_id="n1",
        state_directory=state,
        models_root=tmp_path / "models",
        port=0,
        executables=executables,
    )
    (tmp_path / "models").mkdir()
    agent = AgentServer(
        config=config,
        identity=load_identity(state, node_id="n1"),
        **{"heartbeat_interval": 0.2, **server},
    )
    await agent.start()
    node.address = f"https://127.0.0.1:{agent.port}"
    await sync_to_async(node.save)()
    try:
        yield Enrolled(node=node, server=agent)
    finally:
        await agent.stop()


@pytest.fixture
async def enrolled(tmp_path: Path) -> AsyncIterator[Enrolled]:
    async with start_enrolled(tmp_path) as running:
        yield running


async def stop_workers(monitor: Any) -> None:
    """Stop every worker of a test's Monitor and wait for them to end."""
    for worker, task in monitor.workers.values():
        worker.stop.set()
        task.cancel()
    await asyncio.gather(*(t for _, t in monitor.workers.values()), return_exceptions=True)
