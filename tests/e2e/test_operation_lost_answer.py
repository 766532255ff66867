"""A launch whose answer is lost, on real processes: the master's operation log
(nodes/operations.py) against ``python -m agent run`` with a real llama-server, behind
a TCP proxy that cuts the connection as the agent's answer begins (the agent has
launched, the master never hears of it). The master sends the launch again under the
same operation id; the agent answers from its own log; one engine runs, and the
master's operation is closed succeeded."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nodes.agent_client import AgentClient
from nodes.models import MasterOperation, Node
from tests.e2e.conftest import ROOT, llama_server_or_fail
from tests.e2e.dropping_proxy import DroppingProxy
from tests.e2e.rotation_support import RotationAgent, rotation_rig

# The agent tests' helpers live beside them without a package (pytest puts their folder
# on sys.path the same way when it collects them).
sys.path.insert(0, str(ROOT / "tests" / "agent"))
from agent_support import launch_body
from test_end_to_end import llama_entry

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture
def rig(
    master_identity: Any, tmp_path: Path
) -> Iterator[tuple[Node, RotationAgent, DroppingProxy]]:
    entry = llama_entry(llama_server_or_fail(), tmp_path / "models")  # writes models/tiny
    executables = [{"Name": entry.name, "Version": entry.version, "Path": str(entry.path),
                    "Default": True}]  # fmt: skip
    with rotation_rig(tmp_path, "lossy", lossy=True, config={"Executables": executables}) as (
        node, agent, proxy,
    ):  # fmt: skip
        assert proxy is not None
        yield node, agent, proxy


def _spec() -> dict[str, Any]:
    args = [
        "-m", "{model}", "--alias", "tiny", "-c", "256", "-np", "1", "-ngl", "0",
        "--host", "127.0.0.1", "--port", "{port}", "--no-ui", "--cache-ram", "0", "--fit", "off",
    ]  # fmt: skip
    return launch_body(
        "tiny-1", servedName="tiny", model={"folder": "tiny", "file": "tiny.gguf"}, args=args
    )


def _engines(agent: RotationAgent) -> list[psutil.Process]:
    assert agent.process is not None
    children = psutil.Process(agent.process.pid).children(recursive=True)
    return [p for p in children if p.name() == "llama-server"]


def test_a_launch_whose_answer_is_lost_is_sent_again_and_runs_once(
    rig: tuple[Node, RotationAgent, DroppingProxy],
) -> None:
    node, agent, proxy = rig
    proxy.lose_answer()  # the launch's answer: the agent acts, the master hears nothing
    with AgentClient(node=node) as client:
        answer = client.launch(_spec())
        assert proxy.dropped == 1, "the launch's answer went through"
        assert answer["instanceId"] == "tiny-1"

        (op,) = MasterOperation.objects.all()
        assert (op.kind, op.target, op.state) == ("launch", "tiny-1", "succeeded")
        assert op.attempts == 2 and op.status_code == 202 and op.closed_at is not None
        assert op.summary.startswith("(answered from the agent's log)"), op.summary
        # The agent recorded one launch, under the master's id: the retry carried it.
        log = json.loads((agent.state / "operations.json").read_text())["operations"]
        launches = [o for o in log if o["kind"] == "launch"]
        assert [(o["id"], o["state"]) for o in launches] == [(op.operation_id, "succeeded")]

        deadline = time.monotonic() + 60
        while (state := client.instances()[0]["state"]) == "Starting":
            assert time.monotonic() < deadline, "the engine never became Ready"
            time.sleep(0.2)
        assert state == "Ready", agent.log_tail()
        (instance,) = client.instances()
        engines = _engines(agent)
        assert [p.pid for p in engines] == [instance["pid"]]  # exactly one engine
        client.stop("tiny-1")
    assert MasterOperation.objects.filter(kind="stop", state="succeeded").count() == 1
