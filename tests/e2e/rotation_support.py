"""A real agent to rotate against, for the rotation e2e tests: ``python -m agent run``
on an enrolled state directory, killable, with the master's side in this process."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.identity._tls import generate_key_and_csr, load_identity, store_identity
from nodes import rotation, services
from nodes.agent_client import AgentClient, AgentError
from nodes.models import CertRotation, Node
from tests.e2e.conftest import ROOT, free_port, outside_env
from tests.e2e.dropping_proxy import DroppingProxy


class RotationAgent:
    """``python -m agent run`` on an enrolled state directory, killable."""

    def __init__(self, folder: Path, node_id: str, *, config: dict[str, Any] | None = None) -> None:
        self.folder = folder
        self.node_id = node_id
        self.state = folder / "state"
        self.port = free_port()
        (folder / "models").mkdir(parents=True, exist_ok=True)
        self.config = folder / "agent.json"
        self.config.write_text(
            json.dumps(
                {
                    "NodeId": node_id,
                    "StateDirectory": str(self.state),
                    "ListenAddress": "127.0.0.1",
                    "Port": self.port,
                    "ModelsRoot": str(folder / "models"),
                    **(config or {}),  # e.g. Executables, for a test that launches
                }
            )
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.folder / "agent.log", "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(self.config)],
            cwd=ROOT, env=outside_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)

    def log_tail(self, size: int = 4000) -> str:
        path = self.folder / "agent.log"
        return path.read_text()[-size:] if path.exists() else ""

    def wait_ready(self, node: Node) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                with AgentClient(node=Node.objects.get(pk=node.pk), timeout=2) as client:
                    client.info()
                return
            except AgentError:
                if time.monotonic() > deadline:
                    raise AssertionError(self.log_tail(2000)) from None
                time.sleep(0.1)

    def assert_on_the_pinned_certificate(self, node: Node) -> None:
        """One valid certificate, the one the master pins, and nothing pending."""
        fresh = Node.objects.get(pk=node.pk)
        identity = load_identity(self.state, node_id=self.node_id)
        assert identity.spki_sha256 == fresh.spki_pin
        assert fresh.pending_pin == ""
        assert identity.cert.not_valid_after_utc > dt.datetime.now(dt.UTC)
        assert not list(self.state.glob("*.pending")), list(self.state.iterdir())
        with AgentClient(node=fresh) as client:
            assert client.info()["rotation"] is None


def enroll_for_rotation(folder: Path, node_id: str) -> Node:
    """Enroll ``node_id`` with the master's services into ``folder/state``, approved."""
    token = services.create_token(node_id=node_id, purpose="join", lifetime=dt.timedelta(hours=1))
    key, csr = generate_key_and_csr(node_id)
    answer = services.enroll(token=token, node_id=node_id, csr_pem=csr.decode(), addresses=[])
    store_identity(folder / "state", key=key, cert_pem=answer["certPem"].encode(),
                   ca_pem=answer["caCertPem"].encode())  # fmt: skip
    node = Node.objects.get(node_id=node_id)
    node.approved = True
    node.facts = {"features": ["pki.rotation"]}
    node.save()
    return node


@contextlib.contextmanager
def rotation_rig(
    folder: Path, node_id: str, *, lossy: bool = False, config: dict[str, Any] | None = None
) -> Iterator[tuple[Node, RotationAgent, DroppingProxy | None]]:
    """An enrolled node and its running agent, ready; with ``lossy`` the master reaches it
    through a DroppingProxy; ``config`` adds to the agent's agent.json. The agent's log is
    printed when the body fails."""
    node = enroll_for_rotation(folder, node_id)
    agent = RotationAgent(folder, node_id, config=config)
    proxy = DroppingProxy(upstream_port=agent.port).start() if lossy else None
    node.address = f"https://127.0.0.1:{proxy.port if proxy else agent.port}"
    node.save()
    agent.start()
    try:
        agent.wait_ready(node)
        yield node, agent, proxy
    except BaseException:
        print(agent.log_tail())
        raise
    finally:
        agent.stop()
        if proxy is not None:
            proxy.stop()


def beat_passes(rotation_id: str, passes: int = 10) -> CertRotation:
    """Advance the rotation as the beat's hourly check would, until it closes."""
    done = CertRotation.objects.get(rotation_id=rotation_id)
    for _ in range(passes):
        done = rotation.advance(rotation_id)
        if not done.open:
            break
    return done
