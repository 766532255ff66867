"""``python -m agent run`` as a real process: serves, stops on SIGTERM, refuses a wrong cert."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from agent_support import Pki, client_context, make_identity, master_headers

from tests.parallel import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, state: Path, port: int, node_id: str = "n1") -> Path:
    path = tmp_path / "agent.json"
    config = {"NodeId": node_id, "StateDirectory": str(state), "Port": port}
    path.write_text(json.dumps(config))
    return path


async def test_run_serves_and_stops_on_sigterm(pki: Pki, tmp_path: Path) -> None:
    state = tmp_path / "state"
    make_identity(pki, state, "n1")
    port = free_port()
    config = write_config(tmp_path, state, port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        ctx = client_context(pki, pki.master, tmp_path / "client")
        info = None
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx), headers=master_headers()
        ) as session:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and info is None:
                try:
                    async with session.get(f"https://127.0.0.1:{port}/agent/v1/info") as resp:
                        info = await resp.json()
                except aiohttp.ClientConnectionError:
                    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                    await asyncio.sleep(0.1)
        assert info is not None and info["nodeId"] == "n1"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
        output = proc.stdout.read().decode() if proc.stdout else ""
        assert "listening on https://127.0.0.1" in output and "Agent stopped" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_refuses_a_certificate_for_another_node(pki: Pki, tmp_path: Path) -> None:
    state = tmp_path / "state"
    make_identity(pki, state, "n1")
    config = write_config(tmp_path, state, free_port(), node_id="n2")
    done = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "agent: The agent certificate is for node 'n1', but the config says 'n2'." in done.stderr


def test_run_without_identity_or_bootstrap(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state", free_port())
    done = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "enroll first" in done.stderr
