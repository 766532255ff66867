"""A node in its own network namespace: partition and heal, then kill -9 of its agent.

The agent runs inside a namespace reached over a veth pair (addresses of our
own namespace only). Cutting the link for longer than 15 s makes the node
Offline and /v1 answer node_offline; restoring it brings the node back
without an operator and without a second engine. Killing the agent with -9
and starting it again adopts the running engine: same pid, Ready again.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.e2e.conftest import (
    ROOT,
    create_and_start,
    free_port,
    install_llama_server,
    llama_server_or_fail,
    outside_env,
    run_join,
    wait_for,
)

pytestmark = pytest.mark.slow


def sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@pytest.fixture
def netns():
    if os.geteuid() != 0:
        message = "network namespaces need root (ip netns add)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    tag = f"{random.randrange(16**4):04x}"
    name, host_if, ns_if = f"mbd-{tag}", f"mbh{tag}", f"mbn{tag}"
    octet = random.randrange(1, 250)
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", name)
        sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        sh("ip", "netns", "exec", name, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield {"name": name, "host_if": host_if, "ns_ip": ns_ip}
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], check=False, capture_output=True)


def test_partition_heal_and_agent_kill(make_stack, netns, tmp_path: Path) -> None:
    llama_server_or_fail()
    stack = make_stack(embedded=False)
    facts = stack.start()
    key = facts["API key"]
    api = stack.api(key, timeout=30)
    env = outside_env()
    manifest = install_llama_server(
        tmp_path / "runtimes", {**env, "MIRBAD_BUILD_CACHE": stack.env["MIRBAD_BUILD_CACHE"]}
    )
    models = tmp_path / "models"
    write_tiny_gguf(models / "tiny" / "tiny.gguf")

    port = free_port()
    address = f"https://{netns['ns_ip']}:{port}"
    join = api.post("/api/join-tokens", json={"nodeId": "part-a"}).json()
    state = tmp_path / "state"
    joined = run_join(env, join, state, address)
    assert joined.returncode == 0, joined.stderr
    config = tmp_path / "agent.json"
    config.write_text(
        json.dumps(
            {
                "NodeId": "part-a",
                "StateDirectory": str(state),
                "ListenAddress": netns["ns_ip"],
                "Port": port,
                "ModelsRoot": str(models),
                "Executables": [
                    {
                        "Name": "llama.cpp",
                        "Version": json.loads(manifest.read_text())["version"],
                        "Path": str(manifest.parent / "llama-server"),
                        "Default": True,
                    }
                ],
            }
        )
    )
    log = open(tmp_path / "agent.log", "ab")

    def start_agent() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns["name"],
                sys.executable,
                "-m",
                "agent",
                "run",
                "--config",
                str(config),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    agent = start_agent()
    engines: list[int] = []
    try:
        assert api.post("/api/nodes/part-a/approve").status_code == 200
        wait_for(lambda: api.get("/api/nodes/part-a").json()["state"] == "Online", 30, "Online")
        model_id = create_and_start(
            api,
            {
                "servedName": "part",
                "sourceFolder": "tiny",
                "sourceFile": "tiny.gguf",
                "settings": {"context_size": 256, "gpu_layers": 0},
                "node": "part-a",
            },
        )

        def chat() -> httpx.Response:
            return httpx.post(
                f"{stack.url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={
                    "model": "part",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "x"}],
                },
                timeout=30,
            )

        assert chat().status_code == 200

        def engine_pids() -> list[int]:
            node = api.get("/api/nodes/part-a").json()
            return [i["pid"] for i in node["instances"] if i.get("pid")]

        engines = engine_pids()
        assert len(engines) == 1

        # Partition: the link is cut for longer than the 15 s Offline rule.
        sh("ip", "link", "set", netns["host_if"], "down")
        cut = time.monotonic()
        wait_for(lambda: api.get("/api/nodes/part-a").json()["state"] == "Offline", 30, "Offline")
        print(f"Offline {time.monotonic() - cut:.1f} s after the cut")
        response = chat()
        assert response.status_code == 503 and response.json()["error"]["code"] == "node_offline"
        time.sleep(max(0.0, 17 - (time.monotonic() - cut)))
        sh("ip", "link", "set", netns["host_if"], "up")
        healed = time.monotonic()
        wait_for(lambda: api.get("/api/nodes/part-a").json()["state"] == "Online", 45, "healed")
        print(f"Online again {time.monotonic() - healed:.1f} s after the link came back")
        wait_for(lambda: chat().status_code == 200, 20, "/v1 answering again")
        assert engine_pids() == engines, "no second engine after the partition"
        ours = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "llama-server" in " ".join(p.info["cmdline"] or [])
            and str(models) in " ".join(p.info["cmdline"] or [])
        ]
        assert [p.pid for p in ours] == engines

        # kill -9 of the agent: the engine keeps serving, the next agent adopts it.
        old_boot = api.get("/api/nodes/part-a").json()["bootId"]
        psutil.Process(agent.pid).kill()
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if "agent run" in cmd and str(config) in cmd:
                proc.kill()
        agent.wait(timeout=10)
        assert psutil.pid_exists(engines[0])
        agent = start_agent()

        def back() -> bool:
            node = api.get("/api/nodes/part-a").json()
            return node["state"] == "Online" and node["bootId"] not in (None, old_boot)

        wait_for(back, 45, "the restarted agent Online")
        wait_for(lambda: api.get(f"/api/models/{model_id}").json()["state"] == "Ready", 30, "Ready")
        assert engine_pids() == engines, "the engine was adopted, not restarted"
        answer = chat()
        assert answer.status_code == 200, answer.text

        # A master restart loses nothing: records, pins and the running instance come
        # back from the database and the agent's snapshot; the engine is untouched.
        assert stack.stop() == 0
        stack.start()
        wait_for(lambda: api.get("/api/nodes/part-a").json()["state"] == "Online", 45, "rejoined")
        wait_for(lambda: api.get(f"/api/models/{model_id}").json()["state"] == "Ready", 30, "Ready")
        assert engine_pids() == engines
        assert chat().status_code == 200
    finally:
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if str(config) in cmd or str(models) in cmd:
                proc.kill()
        log.close()
