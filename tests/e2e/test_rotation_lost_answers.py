"""A lost answer at every step of a certificate rotation (issue 13): a TCP proxy
between the master and a real ``python -m agent run`` cuts the connection as the
agent's answer begins, so the agent has done the step and the master never hears of
it. The master's next pass sends the step again (or reads back what happened) and the
rotation completes with nothing done twice: one key, one certificate issued, each
stage stored once, one commit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from agent.identity._rotation import PENDING_KEY_FILE, ROTATION_FILE
from agent.identity._tls import load_identity
from nodes import rotation
from nodes.agent_client import AgentUnreachable
from nodes.models import AuditEvent, CertRotation, Node
from protocol.identity import key_spki_sha256
from tests.e2e.dropping_proxy import DroppingProxy
from tests.e2e.rotation_support import RotationAgent, beat_passes, rotation_rig

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

Stage = CertRotation.Stage


@pytest.fixture
def rig(
    settings: Any, master_identity: Any, tmp_path: Path
) -> Iterator[tuple[Node, RotationAgent, DroppingProxy]]:
    settings.MIRBAD = replace(settings.MIRBAD, rotation_pin_grace_seconds=0.0)
    # Every call of the master goes through the proxy.
    with rotation_rig(tmp_path, "lossy", lossy=True) as (node, agent, proxy):
        assert proxy is not None
        yield node, agent, proxy


def _agent_record(agent: RotationAgent, rotation_id: str) -> dict[str, Any]:
    """The agent's own stored record of the rotation (its state file)."""
    doc = json.loads((agent.state / ROTATION_FILE).read_text())
    for record in [doc.get("active"), *doc.get("history", [])]:
        if record and record["rotationId"] == rotation_id:
            return record
    raise AssertionError(f"the agent has no record of {rotation_id}: {doc}")


def _lose_one(proxy: DroppingProxy, rotation_id: str, *, after: int = 0) -> CertRotation:
    """One step whose answer (after ``after`` that go through) is lost."""
    before = proxy.dropped
    proxy.lose_answer(after=after)
    reached = rotation.advance(rotation_id, steps=1)
    assert proxy.dropped == before + 1, "the step sent nothing the proxy could lose"
    assert reached.last_error, "a lost answer went unnoticed"
    return reached


def _finish(node: Node, agent: RotationAgent, rotation_id: str) -> CertRotation:
    done = beat_passes(rotation_id)
    assert done.stage == Stage.COMMITTED, (done.stage, done.last_error)
    agent.assert_on_the_pinned_certificate(node)
    stages = list(
        AuditEvent.objects.filter(subject=rotation_id, action="rotation.stage").values_list(
            "detail__stage", flat=True
        )
    )
    assert sorted(stages) == sorted(set(stages)), stages  # each stage stored once
    assert AuditEvent.objects.filter(subject=rotation_id, action="rotation.committed").count() == 1
    identity = load_identity(agent.state, node_id=agent.node_id)
    assert format(identity.cert.serial_number, "x") == done.cert_serial  # one certificate
    return done


def test_the_start_answer_lost(rig: tuple[Node, RotationAgent, DroppingProxy]) -> None:
    node, agent, proxy = rig
    opened = rotation.request_rotation(node.node_id)
    reached = _lose_one(proxy, opened.rotation_id)
    assert reached.stage == Stage.REQUESTED
    assert _agent_record(agent, opened.rotation_id)["stage"] == "KeyGenerated"
    key = load_identity(agent.state, node_id=agent.node_id)  # the old one, still in use
    pending = (agent.state / PENDING_KEY_FILE).read_bytes()
    _finish(node, agent, opened.rotation_id)
    made = key_spki_sha256(load_pem_private_key(pending, None).public_key())  # type: ignore[arg-type]  # P-256
    # The retry got the key made for the lost answer, not a second one.
    assert Node.objects.get(pk=node.pk).spki_pin == made != key.spki_sha256


def test_the_install_answer_lost(rig: tuple[Node, RotationAgent, DroppingProxy]) -> None:
    node, agent, proxy = rig
    opened = rotation.request_rotation(node.node_id)
    assert rotation.advance(opened.rotation_id, steps=2).stage == Stage.CERT_ISSUED
    reached = _lose_one(proxy, opened.rotation_id)
    assert reached.stage == Stage.CERT_ISSUED
    assert _agent_record(agent, opened.rotation_id)["stage"] == "CertInstalled"
    done = _finish(node, agent, opened.rotation_id)
    issued = AuditEvent.objects.filter(subject=done.rotation_id, action="rotation.stage",
                                       detail__stage=Stage.CERT_ISSUED)  # fmt: skip
    assert issued.count() == 1


@pytest.mark.parametrize(
    ("after", "agent_stage", "master_stage"),
    [(0, "CertInstalled", Stage.CERT_INSTALLED), (1, "Committed", Stage.COMMITTING)],
    ids=["the proof's read", "the commit"],
)
def test_the_proof_and_the_commit_answers_lost(
    rig: tuple[Node, RotationAgent, DroppingProxy], after: int, agent_stage: str,
    master_stage: str,
) -> None:  # fmt: skip
    node, agent, proxy = rig
    opened = rotation.request_rotation(node.node_id)
    assert rotation.advance(opened.rotation_id, steps=3).stage == Stage.CERT_INSTALLED
    reached = _lose_one(proxy, opened.rotation_id, after=after)
    assert reached.stage == master_stage, reached.last_error
    assert _agent_record(agent, opened.rotation_id)["stage"] == agent_stage
    _finish(node, agent, opened.rotation_id)


def test_the_abort_answer_lost(rig: tuple[Node, RotationAgent, DroppingProxy]) -> None:
    node, agent, proxy = rig
    old_pin = node.spki_pin
    opened = rotation.request_rotation(node.node_id)
    assert rotation.advance(opened.rotation_id, steps=3).stage == Stage.CERT_INSTALLED
    proxy.lose_answer()
    with pytest.raises(AgentUnreachable):
        rotation.abort(opened.rotation_id)
    assert proxy.dropped == 1
    assert _agent_record(agent, opened.rotation_id)["stage"] == "Aborted"
    assert CertRotation.objects.get(rotation_id=opened.rotation_id).open
    closed = rotation.abort(opened.rotation_id)  # sent again: the agent answers the same
    assert closed.stage == Stage.ABORTED and not closed.open
    fresh = Node.objects.get(pk=node.pk)
    assert fresh.spki_pin == old_pin
    agent.assert_on_the_pinned_certificate(node)
