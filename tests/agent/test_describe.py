"""Self-description, the node id default and the expected-subsystem health reasons."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from agent_support import RunningAgent

from agent import load_config
from agent.telemetry._describe import describe, docker_reachable, probe_gpus


def test_describe_reports_cpu_memory_disks(tmp_path: Path) -> None:
    facts = describe(models_root=tmp_path / "models", state_directory=tmp_path)
    assert facts["cpu"]["count"] >= 1 and isinstance(facts["cpu"]["features"], list)
    assert facts["memory"]["totalBytes"] > 0
    assert [d["path"] for d in facts["disks"]] == [str(tmp_path / "models"), str(tmp_path)]
    assert isinstance(facts["addresses"], list)


def test_node_id_defaults_to_the_host_name(tmp_path: Path) -> None:
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"StateDirectory": str(tmp_path / "s")}))
    name = socket.gethostname().split(".")[0].lower()
    assert load_config(config, environ={}).node_id == name


def test_docker_probe_names_the_endpoint(tmp_path: Path) -> None:
    problem = docker_reachable(f"unix://{tmp_path}/missing.sock")
    assert problem is not None and "does not answer" in problem


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_gpu_probe_without_nvidia_smi() -> None:
    assert probe_gpus() == ([], "nvidia-smi is not installed")


@pytest.mark.parametrize(
    "running_agent",
    [
        {
            "docker_expected": True,
            "docker_endpoint": "unix:///nonexistent/docker.sock",
            "gpus_expected": True,
        }
    ],
    indirect=True,
)
async def test_expected_subsystems_are_health_reasons(running_agent: RunningAgent) -> None:
    await running_agent.server.health.refresh()
    async with running_agent.session.get(running_agent.url("/agent/v1/status")) as resp:
        codes = {r["code"] for r in (await resp.json())["health"]["reasons"]}
    assert "docker_unreachable" in codes
    if shutil.which("nvidia-smi") is None:
        assert "gpu_probe_failing" in codes


async def test_info_and_heartbeats_describe_the_node(running_agent: RunningAgent) -> None:
    async with running_agent.session.get(running_agent.url("/agent/v1/info")) as resp:
        info = await resp.json()
    assert {"cpu", "memory", "disks", "gpus", "addresses", "executables"} <= set(info)
    events = await running_agent.session.get(running_agent.url("/agent/v1/events"))
    beat = None
    while beat is None:
        line = (await events.content.readline()).decode()
        if line.startswith("data: ") and '"disks"' in line:
            beat = json.loads(line[6:])
    events.close()
    assert beat["memory"]["totalBytes"] > 0 and beat["disks"]
