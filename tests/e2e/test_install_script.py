"""deploy/agent/install-agent.sh against a temporary root, without systemd."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ROOT, free_port, wait_for

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "deploy" / "agent" / "install-agent.sh"


def test_install_script_refuses_bad_input(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False
        )

    token = run("--token", "s3cret")
    assert token.returncode == 2 and "MIRBAD_JOIN_TOKEN" in token.stderr
    assert "s3cret" not in token.stderr
    bad_id = run("--enroll-url", "https://m:8443", "--ca-hash", "sha256:x", "--node-id", "No")
    assert bad_id.returncode == 2 and "--node-id 'No' is not a valid node id" in bad_id.stderr


def test_install_join_and_run(make_stack, tmp_path: Path) -> None:
    stack = make_stack(embedded=False)
    facts = stack.start()
    api = httpx.Client(
        base_url=stack.url, headers={"Authorization": f"Bearer {facts['API key']}"}, timeout=30
    )
    join = api.post("/api/join-tokens", json={"nodeId": "box-4"}).json()
    port = free_port()
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRBAD_")}
    result = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            "--enroll-url",
            join["enrollUrl"],
            "--ca-hash",
            join["caHash"],
            "--node-id",
            "box-4",
            "--address",
            f"https://127.0.0.4:{port}",
            "--port",
            str(port),
            "--listen",
            "127.0.0.4",
            "--root",
            str(root),
            "--no-start",
        ],
        env={**env, "MIRBAD_JOIN_TOKEN": join["token"], "MIRBAD_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert join["token"] not in result.stdout + result.stderr
    assert "not starting the service" in result.stdout

    unit = (root / "etc/systemd/system/mirbad-agent.service").read_text()
    assert "ExecStart=/opt/mirbad-agent/venv/bin/python -m agent run" in unit
    config = json.loads((root / "etc/mirbad-agent/agent.json").read_text())
    assert config["NodeId"] == "box-4" and config["StateDirectory"] == "/var/lib/mirbad-agent"
    state = root / "var/lib/mirbad-agent"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "agent.key").stat().st_mode) == 0o600
    assert api.get("/api/nodes/box-4").json()["state"] == "PendingApproval"

    # A second run keeps the config and does not join again.
    (root / "etc/mirbad-agent/agent.json").write_text(json.dumps({**config, "Port": port}))
    again = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            "--enroll-url",
            join["enrollUrl"],
            "--ca-hash",
            join["caHash"],
            "--node-id",
            "box-4",
            "--root",
            str(root),
            "--no-start",
        ],
        env={**env, "MIRBAD_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert "keeping the existing" in again.stdout and "already enrolled" in again.stdout

    # Run what the unit would run, from the installed venv, with paths under the root.
    agent = subprocess.Popen(
        [
            str(root / "opt/mirbad-agent/venv/bin/python"),
            "-m",
            "agent",
            "run",
            "--config",
            str(root / "etc/mirbad-agent/agent.json"),
        ],
        env={
            **env,
            "PYTHONPATH": str(root / "opt/mirbad-agent/app"),
            "MIRBAD_AGENT_STATE_DIRECTORY": str(state),
            "MIRBAD_AGENT_MODELS_ROOT": str(root / "srv/mirbad/models"),
        },
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert api.post("/api/nodes/box-4/approve").status_code == 200
        wait_for(lambda: api.get("/api/nodes/box-4").json()["state"] == "Online", 30, "Online")
    finally:
        agent.terminate()
        agent.wait(timeout=30)
