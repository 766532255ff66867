"""The master's operation log (nodes/operations.py) against a real in-process agent over
pinned TLS: recorded before it is sent, sent again under the same id when its answer is
lost, closed with the answer, redacted, and reconciled from the agent's own records."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone
from rest_framework.test import APIClient

from nodes import operations
from nodes.agent_client import AgentClient, AgentRefused, AgentTimeout, AgentUnreachable
from nodes.models import MasterOperation, Node
from nodes.monitor import NodeWorker
from tests.factories import make_node
from tests.nodes.conftest import Enrolled

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(operations, "BACKOFF", (0.0, 0.0))


def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Off the event loop: the agent under test answers on it.
    return sync_to_async(fn, thread_sensitive=False)(*args, **kwargs)


def _rows() -> list[MasterOperation]:
    return list(MasterOperation.objects.order_by("opened_at"))


def _with_client(node: Node, call: Callable[[AgentClient], Any]) -> Any:
    with AgentClient(node=Node.objects.get(pk=node.pk)) as client:
        return call(client)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity", "no_backoff")
async def test_the_operation_is_open_in_the_database_when_the_agent_receives_it(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    begin = enrolled.server.oplog.begin

    async def look_first(op_id: str, **kwargs: Any) -> Any:
        # What another master process (a standby's monitor) would read at this moment.
        seen["row"] = await _run(
            lambda: (
                MasterOperation.objects.filter(operation_id=op_id)
                .values("state", "kind", "target", "attempts", "method")
                .first()
            )
        )
        return await begin(op_id, **kwargs)

    monkeypatch.setattr(enrolled.server.oplog, "begin", look_first)
    with pytest.raises(AgentRefused) as refused:
        await _run(_with_client, enrolled.node, lambda c: c.stop("m-9"))
    assert refused.value.code == "not_found"
    assert seen["row"] == {
        "state": "open", "kind": "stop", "target": "m-9", "attempts": 1, "method": "POST"
    }  # fmt: skip
    (op,) = await _run(_rows)
    assert op.state == "failed" and op.status_code == 404 and not op.reconciled
    assert op.summary.startswith("not_found: ") and op.closed_at is not None
    assert enrolled.server.oplog.operations[op.operation_id]["state"] == "failed"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity", "no_backoff")
async def test_a_lost_answer_is_sent_again_under_the_same_id_and_acted_on_once(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []
    original = httpx.Client.request

    def cut_first_answer(self: httpx.Client, method: str, url: Any, **kwargs: Any) -> Any:
        if method == "GET":
            return original(self, method, url, **kwargs)
        sent.append((kwargs.get("headers") or {})[operations.OPERATION_HEADER])
        response = original(self, method, url, **kwargs)  # the agent acts on it
        if len(sent) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return response

    monkeypatch.setattr(httpx.Client, "request", cut_first_answer)

    rid = "r-0123456789abcdef"

    def start(client: AgentClient) -> Any:
        # A rotation start, sent as a launch is (with retries), for an answer that succeeds.
        return operations.send(
            client, kind=operations.Kind.ROTATION_START, method="POST", path="/pki/rotations",
            target=rid, attempts=3, json={"rotationId": rid},
        )  # fmt: skip

    answer = await _run(_with_client, enrolled.node, start)
    assert answer["stage"] == "KeyGenerated"
    assert len(sent) == 2 and sent[0] == sent[1]  # the same operation id, twice
    (op,) = await _run(_rows)
    assert op.operation_id == sent[0]
    assert op.state == "succeeded" and op.attempts == 2 and op.status_code == 201
    assert op.summary.startswith("(answered from the agent's log)")
    assert "KeyGenerated" in op.summary and "csrPem" not in op.summary
    # The agent did it once: one record, one rotation.
    assert [i for i in enrolled.server.oplog.operations if i == op.operation_id] == [sent[0]]
    assert enrolled.server.rotations.store.active is not None
    assert enrolled.server.rotations.store.active.rotation_id == rid


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity", "no_backoff")
async def test_no_answer_leaves_it_open_and_the_monitor_finds_it_never_arrived(
    enrolled: Enrolled,
) -> None:
    node = enrolled.node
    address = node.address
    await _run(
        Node.objects.filter(pk=node.pk).update, address=f"https://127.0.0.1:{_closed_port()}"
    )
    with pytest.raises(AgentUnreachable) as lost:
        await _run(_with_client, node, lambda c: c.reclaim("tiny"))
    assert not isinstance(lost.value, AgentTimeout)  # a refused connect: nothing was sent
    (op,) = await _run(_rows)
    assert op.state == "open" and op.attempts == operations.ATTEMPTS
    assert op.kind == "reclaim" and op.target == "tiny"
    assert op.summary.startswith(f"no answer after {operations.ATTEMPTS} attempt(s)")
    assert op.sender_deadline <= timezone.now()  # nobody waits on it any more

    await _run(Node.objects.filter(pk=node.pk).update, address=address)
    worker = NodeWorker(node=await _run(Node.objects.get, pk=node.pk), stop=asyncio.Event())
    try:
        await worker.connect()  # the monitor reaches the node: it reconciles
    finally:
        await worker.client.aclose()
    (op,) = await _run(_rows)
    assert op.state == "failed" and op.reconciled and op.closed_at is not None
    assert op.summary == "never reached the agent (it has no record of the operation)"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity", "no_backoff")
async def test_a_repeat_still_running_on_the_agent_is_waited_out_then_reconciled(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    op_id = "m-still-running-0001"
    monkeypatch.setattr(operations, "new_id", lambda: op_id)
    oplog = enrolled.server.oplog
    # The first try is running on the agent (say, its answer was cut and it is slow).
    await oplog.begin(op_id, method="POST", path="/agent/v1/instances/m-7/stop", instance_id=None)
    with pytest.raises(AgentTimeout, match="still running"):
        await _run(_with_client, enrolled.node, lambda c: c.stop("m-7"))
    (op,) = await _run(_rows)
    assert op.state == "open" and op.attempts == operations.ATTEMPTS
    client = NodeWorker(node=enrolled.node, stop=asyncio.Event()).client
    try:
        assert await operations.reconcile(enrolled.node, client) == {"still_open": 1}
        assert (await _run(_rows))[0].state == "open"
        secret = b'{"instanceId": "m-7", "state": "Stopped", "token": "hf_leakleakleak"}'
        await oplog.close(op_id, status=200, body=secret)
        assert await operations.reconcile(enrolled.node, client) == {"succeeded": 1}
    finally:
        await client.aclose()
    (op,) = await _run(_rows)
    assert op.state == "succeeded" and op.reconciled and op.status_code == 200
    assert "Stopped" in op.summary and "hf_leak" not in op.summary


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity", "no_backoff")
async def test_the_monitor_closes_open_operations_with_the_agents_outcomes(
    enrolled: Enrolled,
) -> None:
    node = enrolled.node
    oplog = enrolled.server.oplog
    past = timezone.now() - dt.timedelta(minutes=5)

    def opened(kind: str, target: str, *, waiting: bool = False) -> str:
        op = operations.record(node, kind=kind, method="POST", path=f"/{target}", target=target)
        deadline = timezone.now() + dt.timedelta(minutes=1) if waiting else past
        MasterOperation.objects.filter(pk=op.pk).update(opened_at=past, sender_deadline=deadline)
        return op.operation_id

    ids = {
        name: await _run(opened, "launch", name, waiting=name == "waiting")
        for name in ("done", "refused", "lost", "running", "waiting")
    }
    for name in ("done", "refused", "running", "waiting"):
        await oplog.begin(ids[name], method="POST", path=f"/agent/v1/{name}", instance_id=None)
    await oplog.close(ids["done"], status=202, body=b'{"instanceId": "done", "state": "Starting"}')
    await oplog.close(ids["waiting"], status=202, body=b"{}")
    refusal = b'{"error": {"code": "spec_rejected", "message": "unknown executable"}}'
    await oplog.close(ids["refused"], status=422, body=refusal)

    worker = NodeWorker(node=node, stop=asyncio.Event())
    try:
        await worker.connect()
    finally:
        await worker.client.aclose()
    rows = {op.target: op for op in await _run(_rows)}
    assert {k: (v.state, v.reconciled) for k, v in rows.items()} == {
        "done": ("succeeded", True),
        "refused": ("failed", True),
        "lost": ("failed", True),
        "running": ("open", False),  # the agent is still at it
        "waiting": ("open", False),  # its sender may still get the answer: left alone
    }
    assert rows["done"].status_code == 202 and "Starting" in rows["done"].summary
    assert rows["refused"].status_code == 422
    assert rows["refused"].summary == "spec_rejected: unknown executable"
    assert rows["lost"].summary.startswith("never reached the agent")


def test_summaries_never_keep_a_token() -> None:
    token = "hf_abcdefghijklmnop"
    assert token not in operations.summarize({"request": {"token": token, "repoId": "a/b"}})
    assert operations.redact({"Token": token, "files": [{"apiKey": "k"}], "token": None}) == {
        "Token": "[redacted]", "files": [{"apiKey": "[redacted]"}], "token": None,
    }  # fmt: skip
    refused = {"error": {"code": "upstream", "message": f"401 for ?token={token}"}}
    assert operations.summarize(refused) == "upstream: 401 for ?token=[redacted]"
    assert "Bearer" not in operations.summarize("Authorization: Bearer sekrit-sekrit")
    assert len(operations.summarize({"error": "x" * 5000})) == operations.SUMMARY_CHARS


@pytest.mark.django_db(transaction=True)
def test_recording_inside_a_callers_transaction_commits_with_it() -> None:
    """Outside any transaction the row commits at once; inside a caller's, it shares the
    caller's fate (the editor's save-and-download unit)."""
    node = make_node("n1")
    operations.record(node, kind="stop", method="POST", path="/x", target="m-1")
    with pytest.raises(ValueError), transaction.atomic():
        operations.record(node, kind="stop", method="POST", path="/y", target="m-2")
        raise ValueError("the caller rolls back")
    with transaction.atomic():
        operations.record(node, kind="stop", method="POST", path="/z", target="m-3")
    assert sorted(MasterOperation.objects.values_list("target", flat=True)) == ["m-1", "m-3"]


# -- GET /api/nodes/{id}/operations ---------------------------------------------------


def _listed(node: Node) -> None:
    now = timezone.now()
    for minutes, state in ((3, "succeeded"), (2, "open"), (1, "failed")):
        MasterOperation.objects.create(
            operation_id=f"m-{minutes:032d}", node=node, kind="launch", method="POST",
            path="/instances", target=f"i-{minutes}", state=state,
            opened_at=now - dt.timedelta(minutes=minutes), summary="ok",
        )  # fmt: skip


@pytest.mark.django_db
def test_the_api_lists_a_nodes_operations_newest_first(operator_client: APIClient) -> None:
    _listed(make_node("n1"))
    body = operator_client.get("/api/nodes/n1/operations").json()
    assert [o["target"] for o in body["operations"]] == ["i-1", "i-2", "i-3"]
    assert body["more"] is False
    first = body["operations"][0]
    assert set(first) == {
        "operationId", "kind", "method", "path", "target", "state", "reconciled",
        "statusCode", "summary", "attempts", "openedAt", "closedAt",
    }  # fmt: skip
    only_open = operator_client.get("/api/nodes/n1/operations?state=open").json()
    assert [o["target"] for o in only_open["operations"]] == ["i-2"]
    page = operator_client.get("/api/nodes/n1/operations?limit=2").json()
    assert len(page["operations"]) == 2 and page["more"] is True
    for bad in ("state=closed", "limit=0", "limit=201", "limit=x"):
        refused = operator_client.get(f"/api/nodes/n1/operations?{bad}")
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["details"]["field"] == bad.split("=")[0]
    assert operator_client.get("/api/nodes/nope/operations").status_code == 404


@pytest.mark.django_db
def test_the_operations_without_permission(
    anon_client: APIClient, viewer_client: APIClient, chat_key: str, admin_key: str
) -> None:
    _listed(make_node("n1"))
    anonymous = anon_client.get("/api/nodes/n1/operations")
    assert anonymous.status_code == 401 and "operations" not in anonymous.json()
    viewer = viewer_client.get("/api/nodes/n1/operations")
    assert viewer.status_code == 403 and "operations" not in viewer.json()
    chat = APIClient()
    chat.credentials(HTTP_AUTHORIZATION=f"Bearer {chat_key}")
    assert chat.get("/api/nodes/n1/operations").status_code == 403
    admin = APIClient()
    admin.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    assert len(admin.get("/api/nodes/n1/operations").json()["operations"]) == 3
