"""Two more real agents on their own loopback addresses join with tokens, one is revoked."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, free_port, outside_env, run_join, wait_for

pytestmark = pytest.mark.slow


def test_join_approve_revoke(make_stack, tmp_path: Path) -> None:
    stack = make_stack(embedded=False)
    facts = stack.start()
    api = stack.api(facts["API key"], timeout=30)
    env = outside_env()
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for node_id, ip in (("edge-a", "127.0.0.2"), ("edge-b", "127.0.0.3")):
            join = api.post("/api/join-tokens", json={"nodeId": node_id}).json()
            port = free_port()
            address = f"https://{ip}:{port}"
            state = tmp_path / node_id
            joined = run_join(env, join, state, address)
            assert joined.returncode == 0, joined.stdout + joined.stderr
            assert join["token"] not in joined.stdout + joined.stderr
            node = api.get(f"/api/nodes/{node_id}").json()
            assert node["state"] == "PendingApproval"
            assert node["fingerprint"].removeprefix("SHA256:") in joined.stdout
            # The same token a second time: refused, with the master's reason.
            again = run_join(env, join, tmp_path / f"{node_id}-again", address)
            assert again.returncode != 0 and "already used" in again.stdout + again.stderr
            config = tmp_path / f"{node_id}.json"
            config.write_text(
                json.dumps(
                    {
                        "NodeId": node_id,
                        "StateDirectory": str(state),
                        "ListenAddress": ip,
                        "Port": port,
                        "ModelsRoot": str(tmp_path / f"{node_id}-models"),
                        "StopInstancesOnShutdown": True,
                    }
                )
            )
            (tmp_path / f"{node_id}-models").mkdir()
            log = open(tmp_path / f"{node_id}.log", "wb")
            agents.append(
                subprocess.Popen(
                    [sys.executable, "-m", "agent", "run", "--config", str(config)],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        time.sleep(2)
        # Not approved: the monitor leaves them alone.
        assert api.get("/api/nodes/edge-a").json()["state"] == "PendingApproval"
        for node_id in ("edge-a", "edge-b"):
            assert api.post(f"/api/nodes/{node_id}/approve").status_code == 200
        for node_id in ("edge-a", "edge-b"):
            wait_for(
                lambda n=node_id: api.get(f"/api/nodes/{n}").json()["state"] == "Online",
                30,
                f"{node_id} Online",
            )
        nodes = {n["nodeId"]: n for n in api.get("/api/nodes").json()["nodes"]}
        assert set(nodes) == {"local", "edge-a", "edge-b"}
        assert nodes["edge-a"]["address"].startswith("https://127.0.0.2:")

        assert api.post("/api/nodes/edge-b/revoke").json()["state"] == "Revoked"
        time.sleep(7)  # longer than the monitor's refresh: it must not come back
        assert api.get("/api/nodes/edge-b").json()["state"] == "Revoked"
        assert api.get("/api/nodes/edge-a").json()["state"] == "Online"
        refused = api.post("/api/join-tokens", json={"nodeId": "edge-b"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "node_revoked"
        # The monitor dropped it and never dialed it again.
        monitor_log = (stack.data / "logs" / "monitor.log").read_text()
        assert monitor_log.count("Following node edge-b") == 1, monitor_log
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(timeout=30)
