"""The hollow agent of bench/fleet.py against the real master and monitor.

bench/hollow.py's agents stand in for machines in the fleet bench; this proves they are
followed exactly as real agents are: a join token and a real enrollment, approval,
Online, an instance started and stopped through /api, then a killed node shown Offline
15 to 20 s after its last contact (docs/performance.md, "A fleet of a thousand
machines"). The bench's figures are only worth what this test holds.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.hollow import Worker
from tests.e2e.conftest import free_port, outside_env, wait_for

pytestmark = pytest.mark.slow


def test_hollow_agents_enroll_serve_and_die(make_stack, tmp_path: Path) -> None:
    stack = make_stack(embedded=False)
    facts = stack.start()
    api = stack.api(facts["API key"], timeout=30)
    port = free_port()
    nodes = []
    for index, node_id in enumerate(("hollow-a", "hollow-b")):
        join = api.post("/api/join-tokens", json={"nodeId": node_id}).json()
        nodes.append({"nodeId": node_id, "ip": f"127.0.9.{index + 1}", "port": port, **join})
    worker = Worker(
        folder=tmp_path / "hollow", nodes=nodes, log_path=tmp_path / "hollow.log", env=outside_env()
    )
    try:
        started = worker.start(timeout=120)
        assert started["ready"] == 2, started
        for node_id in ("hollow-a", "hollow-b"):
            assert api.get(f"/api/nodes/{node_id}").json()["state"] == "PendingApproval"
            assert api.post(f"/api/nodes/{node_id}/approve").status_code == 200
        for node_id in ("hollow-a", "hollow-b"):
            wait_for(
                lambda n=node_id: api.get(f"/api/nodes/{n}").json()["state"] == "Online",
                30,
                f"{node_id} Online",
            )
        node = api.get("/api/nodes/hollow-a").json()
        assert node["address"] == f"https://127.0.9.1:{port}"

        # A model placed on the hollow node: the master reads the GGUF header from the
        # agent, admits it, starts it; the hollow runtime reports Starting, then Ready.
        created = api.post(
            "/api/models",
            json={
                "servedName": "hollow-tiny",
                "sourceFolder": "tiny",
                "sourceFile": "tiny.gguf",
                "settings": {"context_size": 256, "gpu_layers": 0},
                "node": "hollow-a",
            },
        )
        assert created.status_code == 201, created.text
        model_id = created.json()["id"]
        assert api.post(f"/api/models/{model_id}/start").status_code == 202
        wait_for(lambda: api.get(f"/api/models/{model_id}").json()["state"] == "Ready", 30, "Ready")
        instances = api.get("/api/nodes/hollow-a").json()["instances"]
        assert [i["state"] for i in instances] == ["Ready"], instances
        assert instances[0]["measured"]["bytes"] > 0
        assert api.post(f"/api/models/{model_id}/stop").status_code == 200
        wait_for(
            lambda: api.get(f"/api/models/{model_id}").json()["state"] == "Stopped", 30, "Stopped"
        )

        # Killed: the monitor loses it and shows it Offline 15 to 20 s after last contact.
        last_seen_before = api.get("/api/nodes/hollow-b").json()["lastSeen"]
        assert last_seen_before is not None
        killed_at = worker.kill_node("hollow-b")
        wait_for(
            lambda: api.get("/api/nodes/hollow-b").json()["state"] == "Offline",
            40,
            "hollow-b Offline",
            interval=0.2,
        )
        shown = time.time()
        last_seen = api.get("/api/nodes/hollow-b").json()["lastSeen"]
        assert last_seen is not None
        assert last_seen <= killed_at + 0.5, (last_seen, killed_at)
        assert 15.0 <= shown - last_seen <= 21.0, shown - last_seen
        # The other node is untouched.
        assert api.get("/api/nodes/hollow-a").json()["state"] == "Online"
    finally:
        worker.stop()
        print("--- hollow worker log (tail) ---")
        print("\n".join((tmp_path / "hollow.log").read_text(errors="replace").splitlines()[-20:]))
