"""The master's side of a two-phase certificate rotation (nodes/rotation.py) against a
real AgentServer over real pinned TLS: every stage, resuming from each stored stage,
lost answers, aborts, and an agent rotation the master never recorded."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async

from core.errors import ServiceError
from nodes import rotation
from nodes.agent_client import AgentClient, AgentTimeout
from nodes.models import CertRotation, Node
from tests.nodes.conftest import Enrolled

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]

Stage = CertRotation.Stage


@pytest.fixture
def rotating(settings: Any, master_identity: Any) -> None:
    """No pin grace (nothing caches routes here), and a fencing epoch to send."""
    settings.MIRBAD = replace(settings.MIRBAD, rotation_pin_grace_seconds=0.0)


async def _ready(enrolled: Enrolled) -> Node:
    def mark() -> Node:
        Node.objects.filter(pk=enrolled.node.pk).update(facts={"features": ["pki.rotation"]})
        return Node.objects.get(pk=enrolled.node.pk)

    return await sync_to_async(mark)()


def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Off the event loop: the agent under test answers on it.
    return sync_to_async(fn, thread_sensitive=False)(*args, **kwargs)


def _node(pk: int) -> Node:
    return Node.objects.get(pk=pk)


async def test_a_rotation_goes_through_every_stage_to_the_new_pin(
    rotating: None, enrolled: Enrolled
) -> None:
    node = await _ready(enrolled)
    old = node.spki_pin
    opened = await _run(rotation.request_rotation, "n1")
    done = await _run(rotation.advance, opened.rotation_id)
    assert done.stage == Stage.COMMITTED and not done.open, done.last_error
    after = await _run(_node, node.pk)
    assert after.spki_pin == done.pending_spki != old
    assert after.pending_pin == "" and after.cert_serial == done.cert_serial
    assert enrolled.server.identity.spki_sha256 == after.spki_pin

    # The master dials the node on the new pin alone, and the agent presents it.
    def info() -> dict[str, Any]:
        with AgentClient(node=after) as client:
            return client.info()

    assert (await _run(info))["spkiSha256"] == after.spki_pin


async def test_one_rotation_open_per_node(rotating: None, enrolled: Enrolled) -> None:
    await _ready(enrolled)
    first = await _run(rotation.request_rotation, "n1")
    with pytest.raises(ServiceError) as refused:
        await _run(rotation.request_rotation, "n1")
    assert refused.value.status == 409 and refused.value.code == "invalid_state"
    assert refused.value.details == {"activeRotationId": first.rotation_id}


async def test_the_master_resumes_from_every_stored_stage(
    rotating: None, enrolled: Enrolled
) -> None:
    """Each call is a master that crashed after the last stage it stored: a new pass
    reads only the database and goes on from there."""
    await _ready(enrolled)
    opened = await _run(rotation.request_rotation, "n1")
    seen = [opened.stage]
    while True:
        current = await _run(rotation.advance, opened.rotation_id, steps=1)
        seen.append(current.stage)
        if not current.open:
            break
        assert len(seen) < 10, seen
    assert seen == [
        Stage.REQUESTED, Stage.CSR_RECEIVED, Stage.CERT_ISSUED, Stage.CERT_INSTALLED,
        Stage.COMMITTED, Stage.COMMITTED,
    ], seen  # fmt: skip
    assert enrolled.server.identity.spki_sha256 == current.pending_spki


async def test_lost_answers_at_every_step_finish_once(
    rotating: None, enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent acts on each step but its answer never arrives (once per step): the
    next passes find where it got to, and the agent ends with one rotation."""
    await _ready(enrolled)
    lost: set[str] = set()
    original = AgentClient._request

    def losing(self: AgentClient, method: str, path: str, **kwargs: Any) -> Any:
        answer = original(self, method, path, **kwargs)
        if method != "GET" and path not in lost:
            lost.add(path)
            raise AgentTimeout(f"lost the answer to {method} {path}")
        return answer

    original_post = httpx.Client.post

    def losing_post(self: httpx.Client, url: Any, **kwargs: Any) -> httpx.Response:
        answer = original_post(self, url, **kwargs)
        if str(url).endswith("/commit") and "commit" not in lost:
            lost.add("commit")
            raise httpx.ReadTimeout("lost the commit's answer")
        return answer

    monkeypatch.setattr(AgentClient, "_request", losing)
    monkeypatch.setattr(httpx.Client, "post", losing_post)
    opened = await _run(rotation.request_rotation, "n1")
    for _ in range(12):  # passes of the beat
        current = await _run(rotation.advance, opened.rotation_id)
        if not current.open:
            break
    assert current.stage == Stage.COMMITTED, current.last_error
    assert "commit" in lost and any(p.endswith("/cert") for p in lost)
    store = enrolled.server.rotations.store
    assert store.active is None
    assert [r.rotation_id for r in store.history] == [opened.rotation_id]
    assert enrolled.server.identity.spki_sha256 == current.pending_spki
    after = await _run(_node, enrolled.node.pk)
    assert after.spki_pin == current.pending_spki and after.pending_pin == ""


async def test_abort_before_commit_and_not_after(rotating: None, enrolled: Enrolled) -> None:
    node = await _ready(enrolled)
    old = node.spki_pin
    opened = await _run(rotation.request_rotation, "n1")
    installed = await _run(rotation.advance, opened.rotation_id, steps=3)
    assert installed.stage == Stage.CERT_INSTALLED
    assert sorted((await _run(_node, node.pk)).pins) == sorted([old, installed.pending_spki])
    aborted = await _run(rotation.abort, opened.rotation_id)
    assert aborted.stage == Stage.ABORTED and not aborted.open
    after = await _run(_node, node.pk)
    assert after.pins == [old]
    assert enrolled.server.rotations.store.active is None
    assert enrolled.server.rotations.context is not None
    assert enrolled.server.rotations.context.presented_spki == old
    # A committed one cannot be aborted.
    second = await _run(rotation.request_rotation, "n1")
    assert (await _run(rotation.advance, second.rotation_id)).stage == Stage.COMMITTED
    with pytest.raises(ServiceError) as refused:
        await _run(rotation.abort, second.rotation_id)
    assert refused.value.status == 409 and refused.value.code == "already_committed"


async def test_an_agent_rotation_the_master_never_recorded_is_aborted(
    rotating: None, enrolled: Enrolled
) -> None:
    node = await _ready(enrolled)
    orphan = "r-" + uuid.uuid4().hex

    def start_orphan() -> None:
        with AgentClient(node=node) as client:
            client.rotation_start(orphan)

    await _run(start_orphan)
    opened = await _run(rotation.request_rotation, "n1")
    done = await _run(rotation.advance, opened.rotation_id)
    assert done.stage == Stage.COMMITTED, done.last_error
    history = {r.rotation_id: r.stage for r in enrolled.server.rotations.store.history}
    assert history == {orphan: "Aborted", opened.rotation_id: "Committed"}


async def test_due_renewals_start_from_the_beat(
    rotating: None, enrolled: Enrolled, settings: Any
) -> None:
    node = await _ready(enrolled)
    assert await _run(rotation.due_for_renewal) == []  # 90 days left, renewal at 30
    settings.MIRBAD = replace(
        settings.MIRBAD, cert_renew_before_seconds=90 * 86400 + 60, cert_renew_jitter_seconds=0
    )
    assert [n.node_id for n in await _run(rotation.due_for_renewal)] == ["n1"]
    counts = await _run(rotation.check_certificates)
    assert counts == {"started": 1, "driven": 1}
    after = await _run(_node, node.pk)
    assert after.spki_pin != node.spki_pin
    scheduled = await _run(lambda: CertRotation.objects.get(node=after))
    assert scheduled.reason == "scheduled" and scheduled.stage == Stage.COMMITTED


async def test_rotate_now_through_the_api(rotating: None, enrolled: Enrolled) -> None:
    """POST /api/nodes/{id}/rotate opens the rotation and queues it; the node shows it."""
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    await _ready(enrolled)

    def call() -> tuple[int, dict[str, Any], dict[str, Any]]:
        client = APIClient()
        operator = get_user_model().objects.create_user("op", password="pw-op-1", is_staff=True)
        client.force_authenticate(operator)
        answer = client.post("/api/nodes/n1/rotate")
        again = client.post("/api/nodes/n1/rotate")
        shown = client.get("/api/nodes/n1").json()
        return answer.status_code, answer.json(), {"again": again.json(), "node": shown}

    status, body, rest = await _run(call)
    assert status == 202 and body["stage"] == "Requested" and body["reason"] == "operator"
    assert rest["again"]["error"]["code"] == "invalid_state"
    assert rest["again"]["error"]["details"] == {"activeRotationId": body["rotationId"]}
    assert rest["node"]["rotation"]["rotationId"] == body["rotationId"]


async def test_a_failed_step_is_kept_on_the_node_until_a_rotation_commits(
    rotating: None, enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nodes.agent_client import AgentUnreachable

    node = await _ready(enrolled)

    def unreachable(self: AgentClient, rotation_id: str) -> Any:
        raise AgentUnreachable("node n1: ConnectError: connection refused")

    monkeypatch.setattr(AgentClient, "rotation_start", unreachable)
    opened = await _run(rotation.request_rotation, "n1")
    failed = await _run(rotation.advance, opened.rotation_id)
    assert failed.open and failed.stage == Stage.REQUESTED and failed.attempts == 1
    assert "connection refused" in (await _run(_node, node.pk)).cert_renewal_error
    monkeypatch.undo()
    done = await _run(rotation.advance, opened.rotation_id)
    assert done.stage == Stage.COMMITTED
    assert (await _run(_node, node.pk)).cert_renewal_error == ""


async def test_the_audit_log_records_each_rotation(rotating: None, enrolled: Enrolled) -> None:
    from nodes.models import AuditEvent

    await _ready(enrolled)
    opened = await _run(rotation.request_rotation, "n1", actor="alice")
    await _run(rotation.advance, opened.rotation_id)

    def events() -> list[tuple[str, str, str]]:
        rows = AuditEvent.objects.filter(subject=opened.rotation_id).order_by("id")
        return [(e.actor, e.action, e.detail.get("stage", "")) for e in rows]

    assert await _run(events) == [
        ("alice", "rotation.requested", ""),
        ("system", "rotation.stage", "CsrReceived"),
        ("system", "rotation.stage", "CertIssued"),
        ("system", "rotation.stage", "CertInstalled"),
        ("system", "rotation.stage", "Committing"),
        ("system", "rotation.stage", "Committed"),
        ("system", "rotation.committed", ""),
    ]
