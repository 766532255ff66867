"""Node certificates renew themselves under load (issue 13): with 300 s node
certificates due about 20 s after they are issued, three real agents (the stack's own,
serving the tiny model on llama-server, and two joined ones) each go through a
two-phase rotation driven by Celery beat while /v1 traffic flows the whole time.
Zero failed requests, every node Online on a new pin at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    ROOT,
    Stack,
    create_and_start,
    free_port,
    llama_server_or_fail,
    outside_env,
    run_join,
    wait_for,
)

pytestmark = pytest.mark.slow

TINY = {
    "servedName": "tiny",
    "sourceFolder": "tiny",
    "sourceFile": "tiny.gguf",
    "settings": {"context_size": 256, "parallel": 1, "gpu_layers": 0},
    "node": "local",
}
# A certificate is valid from a tenth of its lifetime back (the clock-skew backdate), so
# one of 300 s has 270 s left when issued and is due 20 s later (minus the jitter).
ROTATION_ENV = {
    "MIRBAD_NODE_CERT_SECONDS": "300",
    "MIRBAD_CERT_RENEW_BEFORE_SECONDS": "250",
    "MIRBAD_CERT_RENEW_JITTER_SECONDS": "5",
    "MIRBAD_CERT_CHECK_SECONDS": "2",
    "MIRBAD_ROTATION_PIN_GRACE_SECONDS": "1",
    "MIRBAD_CERT_EXPIRING_SECONDS": "30",  # Degraded only if a renewal is 4 min late
}


class Traffic:
    """Sequential /v1 requests on one thread until stopped; every failure is kept."""

    def __init__(self, stack: Stack, key: str) -> None:
        self.stack, self.key = stack, key
        self.sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(
                        f"{self.stack.url}/v1/chat/completions",
                        headers={"Authorization": f"Bearer {self.key}"},
                        json={"model": "tiny", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "Hi"}]},
                    )  # fmt: skip
                    if response.status_code != 200:
                        self.failures.append(f"{response.status_code}: {response.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.sent += 1

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _join(api: httpx.Client, tmp_path: Path, node_id: str, ip: str) -> subprocess.Popen[bytes]:
    join = api.post("/api/join-tokens", json={"nodeId": node_id}).json()
    port = free_port()
    state = tmp_path / node_id
    joined = run_join(outside_env(), join, state, f"https://{ip}:{port}")
    assert joined.returncode == 0, joined.stdout + joined.stderr
    (tmp_path / f"{node_id}-models").mkdir()
    config = tmp_path / f"{node_id}.json"
    config.write_text(
        json.dumps(
            {
                "NodeId": node_id,
                "StateDirectory": str(state),
                "ListenAddress": ip,
                "Port": port,
                "ModelsRoot": str(tmp_path / f"{node_id}-models"),
            }
        )
    )
    with open(tmp_path / f"{node_id}.log", "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(config)],
            cwd=ROOT, env=outside_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    assert api.post(f"/api/nodes/{node_id}/approve").status_code == 200
    return agent


def test_three_nodes_rotate_under_v1_traffic(make_stack, tmp_path: Path) -> None:
    llama_server_or_fail()
    stack = make_stack(embedded=True)
    stack.env.update(ROTATION_ENV)
    stack.prepare_local_model()
    facts = stack.start()
    api = stack.api(facts["API key"], timeout=30)
    agents: list[subprocess.Popen[bytes]] = []
    try:
        create_and_start(api, TINY, timeout=120)
        for node_id, ip in (("edge-a", "127.0.0.2"), ("edge-b", "127.0.0.3")):
            agents.append(_join(api, tmp_path, node_id, ip))
        nodes = ("local", "edge-a", "edge-b")
        for node_id in nodes:
            wait_for(lambda n=node_id: api.get(f"/api/nodes/{n}").json()["state"] == "Online",
                     30, f"{node_id} Online")  # fmt: skip
        first = {n: api.get(f"/api/nodes/{n}").json()["fingerprint"] for n in nodes}
        with Traffic(stack, facts["API key"]) as traffic:

            def all_rotated() -> bool:
                now = {n: api.get(f"/api/nodes/{n}").json() for n in nodes}
                return all(
                    now[n]["fingerprint"] != first[n] and now[n]["rotation"] is None for n in nodes
                )

            wait_for(all_rotated, 120, "every node on a new certificate", interval=1)
            time.sleep(3)  # traffic on the new pins for a moment
        assert traffic.sent > 20, traffic.sent
        assert traffic.failures == [], traffic.failures[:10]
        for node_id in nodes:
            node = api.get(f"/api/nodes/{node_id}").json()
            assert node["state"] == "Online", node
            assert node["fingerprint"] != first[node_id]
    except BaseException:
        stack.print_logs()
        for log in sorted(tmp_path.glob("edge-*.log")):
            print(f"--- {log.name} ---\n" + log.read_text(errors="replace")[-3000:])
        raise
    finally:
        for agent in agents:
            agent.terminate()
            agent.wait(timeout=20)
        stack.stop()
