"""The master's processes outlive their own certificates (issue 13): with 20 s master
certificates, a stack runs through several lifetimes without a restart while the
monitor keeps the node Online, /v1 serves, the master still commands the agent and a new
node joins through the enroll listener at the end. Real processes throughout: the
launcher and its children, the local agent, llama-server, and a second agent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from cryptography import x509

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

LIFETIME = 20  # seconds: re-issued every 10 s
PROCESSES = ("web", "monitor", "enroll", "worker")
TINY = {
    "servedName": "tiny",
    "sourceFolder": "tiny",
    "sourceFile": "tiny.gguf",
    "settings": {"context_size": 256, "parallel": 1, "gpu_layers": 0},
    "node": "local",
}


def _serial(stack: Stack, name: str) -> int | None:
    try:
        data = (stack.data / "pki" / f"{name}.pem").read_bytes()
        return x509.load_pem_x509_certificate(data).serial_number
    except (OSError, ValueError):
        return None  # being replaced this instant


def _chat(stack: Stack, key: str) -> int:
    try:
        return httpx.post(
            f"{stack.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 2},
            timeout=30,
        ).status_code  # fmt: skip
    except httpx.HTTPError as exc:
        return -len(str(exc))  # not a status: counted as a failure below


def test_the_master_outlives_its_certificates(make_stack, tmp_path: Path) -> None:
    llama_server_or_fail()
    stack = make_stack(embedded=True)
    stack.env.update({"MIRBAD_MASTER_CERT_SECONDS": str(LIFETIME), "MIRBAD_PKI_CHECK_SECONDS": "1"})
    stack.prepare_local_model()
    facts = stack.start()
    key = facts["API key"]
    api = stack.api(key, timeout=30)
    agent: subprocess.Popen[bytes] | None = None
    try:
        model_id = create_and_start(api, TINY, timeout=120)
        pids = {name: stack.pid(name) for name in PROCESSES}
        first_client = _serial(stack, "master-client")
        clients, enrolls = {first_client}, {_serial(stack, "enroll")}
        failures: list[str] = []
        started = time.monotonic()
        # Three lifetimes: every certificate the stack started with has expired twice over.
        while time.monotonic() - started < 3 * LIFETIME:
            status = _chat(stack, key)
            if status != 200:
                failures.append(f"/v1 at {time.monotonic() - started:.1f} s: {status}")
            state = api.get("/api/nodes/local").json()["state"]
            if state != "Online":
                failures.append(f"local {state} at {time.monotonic() - started:.1f} s")
            clients.add(_serial(stack, "master-client"))
            enrolls.add(_serial(stack, "enroll"))
            time.sleep(1)
        clients.discard(None)
        enrolls.discard(None)
        assert not failures, failures
        assert len(clients) >= 5, clients  # re-issued every half life, in the running stack
        assert len(enrolls) >= 5, enrolls
        assert {name: stack.pid(name) for name in PROCESSES} == pids  # nothing restarted
        for pid in pids.values():
            assert psutil.Process(pid).is_running()

        # The master still commands the agent (on a certificate issued since): stop, start.
        assert api.post(f"/api/models/{model_id}/stop").status_code in (200, 202)
        wait_for(
            lambda: api.get(f"/api/models/{model_id}").json()["state"] == "Stopped",
            60, "the model Stopped",
        )  # fmt: skip
        assert api.post(f"/api/models/{model_id}/start").status_code == 202
        wait_for(lambda: _chat(stack, key) == 200, 120, "/v1 serving again")

        # A new node joins through the enroll listener, on its re-issued certificate.
        join = api.post("/api/join-tokens", json={"nodeId": "late"}).json()
        port = free_port()
        state_dir = tmp_path / "late"
        joined = run_join(outside_env(), join, state_dir, f"https://127.0.0.2:{port}")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        config = tmp_path / "late.json"
        (tmp_path / "late-models").mkdir()
        config.write_text(
            json.dumps(
                {
                    "NodeId": "late",
                    "StateDirectory": str(state_dir),
                    "ListenAddress": "127.0.0.2",
                    "Port": port,
                    "ModelsRoot": str(tmp_path / "late-models"),
                }
            )
        )
        with open(tmp_path / "late.log", "wb") as log:
            agent = subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--config", str(config)],
                cwd=ROOT, env=outside_env(), stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        assert api.post("/api/nodes/late/approve").status_code == 200
        wait_for(lambda: api.get("/api/nodes/late").json()["state"] == "Online", 30, "late Online")
    except BaseException:
        stack.print_logs()
        raise
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=20)
        stack.stop()
