"""The audit log: each audited action, performed as an operator would, leaves its record
(who, from where, what, when) with secrets masked; the page, the API, the CSV and the
retention rule that show and keep them (docs/operator-guide.md, "Audit log")."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from models_registry.models import ModelDefinition, Placement
from nodes import audit
from nodes.models import AuditEvent, Node
from nodes.monitor import NodeWorker
from protocol.tinygguf import write_tiny_gguf
from router import keys
from tests.agent.agent_support import make_fake_engine
from tests.nodes.conftest import Enrolled, start_enrolled

PASSWORD = "pw-audit-operator-1"
ADDRESS = "10.9.8.7"


@pytest.fixture
async def serving(tmp_path: Path) -> AsyncIterator[Enrolled]:
    """An enrolled in-process agent whose llama-server is a small fake HTTP engine."""
    engine = make_fake_engine(tmp_path)
    async with start_enrolled(
        tmp_path, executables=(engine,), ready_poll_interval=0.1, stop_grace_seconds=2.0
    ) as running:
        yield running


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    # Off the event loop: the agent under test answers on it.
    return sync_to_async(fn, thread_sensitive=False)(*args)


def _events() -> list[tuple[str, str, str, str, str]]:
    rows = AuditEvent.objects.order_by("id")
    return [(e.action, e.actor, e.source, e.node_id, e.subject) for e in rows]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_each_audited_action_leaves_its_record(serving: Enrolled, settings: Any) -> None:
    settings.MIRBAD = replace(settings.MIRBAD, rotation_pin_grace_seconds=0.0)
    worker = NodeWorker(node=serving.node, stop=asyncio.Event())
    try:
        await worker.connect()  # Online, so starts and stops reach the agent
    finally:
        await worker.client.aclose()
    write_tiny_gguf(serving.server.config.models_root_path / "tiny" / "tiny.gguf")
    secrets_seen: list[str] = []

    def act() -> None:
        get_user_model().objects.create_user("alice", password=PASSWORD, is_staff=True)
        browser = Client(REMOTE_ADDR=ADDRESS)
        # A wrong password, then the right one, then out: three records.
        refused = browser.post("/login/", {"username": "alice", "password": "wrong-1"})
        assert refused.status_code == 200
        assert (
            browser.post("/login/", {"username": "alice", "password": PASSWORD}).status_code == 302
        )
        api = APIClient(REMOTE_ADDR=ADDRESS)
        api.force_authenticate(get_user_model().objects.get(username="alice"))

        created = api.post("/api/keys", {"name": "ci", "scopes": ["admin", "chat"]}, format="json")
        assert created.status_code == 201, created.json()
        key = created.json()["key"]
        secrets_seen.append(key)
        # The key itself now acts: its records name it by its public prefix.
        by_key = APIClient(REMOTE_ADDR="10.0.0.2", HTTP_AUTHORIZATION=f"Bearer {key}")
        joined = by_key.post("/api/join-tokens", {"nodeId": "n2"}, format="json")
        assert joined.status_code == 201, joined.json()
        secrets_seen.append(joined.json()["token"])

        Node.objects.filter(node_id="n1").update(approved=False)
        assert api.post("/api/nodes/n1/approve").status_code == 200
        model = ModelDefinition.objects.create(
            served_name="tiny", source_folder="tiny", source_file="tiny.gguf",
            settings={"context_size": 256},
        )  # fmt: skip
        Placement.objects.create(model=model, node=Node.objects.get(node_id="n1"))
        started = api.post(f"/api/models/{model.pk}/start", {}, format="json")
        assert started.status_code == 202, started.json()
        stopped = api.post(f"/api/models/{model.pk}/stop", {}, format="json")
        assert stopped.status_code == 200, stopped.json()
        assert api.post("/api/takeover").status_code == 200
        rekeyed = api.post("/api/nodes/n1/rekey", {}, format="json")
        assert rekeyed.status_code == 201, rekeyed.json()
        secrets_seen.append(rekeyed.json()["token"])
        Node.objects.filter(node_id="n1").update(facts={"features": ["pki.rotation"]})
        assert api.post("/api/nodes/n1/rotate").status_code == 202
        revoked = by_key.delete(f"/api/keys/{created.json()['id']}")
        assert revoked.status_code == 204, revoked.content
        assert api.post("/api/nodes/n1/revoke").status_code == 200
        assert browser.post("/logout/").status_code in (200, 302)

    await _run(act)
    events = await _run(_events)
    prefix = secrets_seen[0][:10]
    by_key = f"key {prefix}… (#"
    wanted = [
        ("login.failed", "alice", ADDRESS, "", ""),
        ("login", "alice", ADDRESS, "", ""),
        ("apikey.created", "alice", ADDRESS, "", prefix),
        ("node.join_token_issued", by_key, "10.0.0.2", "n2", ""),
        ("node.approved", "alice", ADDRESS, "n1", ""),
        ("model.started", "alice", ADDRESS, "n1", "tiny"),
        ("model.stopped", "alice", ADDRESS, "n1", "tiny"),
        ("master.takeover", "alice", ADDRESS, "", ""),
        ("node.rekey_token_issued", "alice", ADDRESS, "n1", ""),
        ("rotation.requested", "alice", ADDRESS, "n1", None),
        ("apikey.revoked", by_key, "10.0.0.2", "", prefix),
        ("node.revoked", "alice", ADDRESS, "n1", ""),
        ("logout", "alice", ADDRESS, "", ""),
    ]
    audited = [
        e for e in events if not e[0].startswith("rotation.") or e[0] == "rotation.requested"
    ]
    assert len(audited) == len(wanted), audited
    for got, want in zip(audited, wanted, strict=True):
        action, actor, source, node_id, subject = want
        assert got[0] == action, (got, want)
        assert got[1].startswith(actor) if actor == by_key else got[1] == actor, (got, want)
        assert got[2:4] == (source, node_id), (got, want)
        assert subject is None or got[4] == subject, (got, want)

    # Not one secret created in the run is in a row, as a whole or as its body.
    dumped = await _run(lambda: repr(list(AuditEvent.objects.values())))
    for secret in secrets_seen:
        assert secret not in dumped and secret[-20:] not in dumped


def test_mask_hides_secret_values_by_name_and_keys_in_text() -> None:
    detail = {
        "hfToken": "hf_abcdefghijklmnop",
        "nested": {"join_token": "zzz", "passphrase": "p", "keyId": 4, "prefix": "mbd-Ab12Cd"},
        "error": "refused Bearer abc.def for mbd-AAAAAAAAAAAAAAAAAAAA",
        "list": [{"apiKey": "x"}],
        "emptyToken": "",
    }
    masked = audit.mask(detail)
    assert masked["hfToken"] == audit.MASK
    assert masked["nested"] == {
        "join_token": audit.MASK, "passphrase": audit.MASK, "keyId": 4, "prefix": "mbd-Ab12Cd",
    }  # fmt: skip
    assert "abc.def" not in masked["error"] and "AAAAAAAA" not in masked["error"]
    assert masked["list"] == [{"apiKey": audit.MASK}]
    assert masked["emptyToken"] == ""


@pytest.mark.django_db
def test_origin_outside_a_request_is_system_or_what_the_command_says() -> None:
    assert audit.record("x.test").actor == "system"
    with audit.acting_as("manage.py takeover", "local"):
        event = audit.record("x.test")
    assert (event.actor, event.source) == ("manage.py takeover", "local")


@pytest.mark.django_db
def test_prune_keeps_the_configured_days() -> None:
    old = audit.record("x.old")
    AuditEvent.objects.filter(pk=old.pk).update(at=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
    kept = audit.record("x.new")
    assert audit.prune(keep_days=30) == 1
    assert list(AuditEvent.objects.values_list("pk", flat=True)) == [kept.pk]


@pytest.mark.django_db
def test_api_filters_pages_and_csv(operator_client: APIClient) -> None:
    for index in range(5):
        audit.record("model.started", node_id=f"n{index}", subject="=cmd|' /C calc'!A0")
    audit.record("login.failed", actor="mallory")
    first = operator_client.get("/api/audit", {"action": "model", "limit": 2}).json()
    assert [e["nodeId"] for e in first["events"]] == ["n4", "n3"]
    second = operator_client.get("/api/audit", {"action": "model", "limit": 2,
                                                "before": first["next"]}).json()  # fmt: skip
    assert [e["nodeId"] for e in second["events"]] == ["n2", "n1"]
    assert operator_client.get("/api/audit", {"actor": "mall"}).json()["events"][0]["action"] == (
        "login.failed"
    )
    bad = operator_client.get("/api/audit", {"from": "yesterday"})
    assert bad.status_code == 400 and "from:" in bad.json()["error"]["message"]

    answer = operator_client.get("/api/audit.csv", {"action": "model.started"})
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(b"".join(answer.streaming_content).decode())))
    assert rows[0] == list(audit.CSV_COLUMNS)
    assert len(rows) == 6
    # A formula an attacker typed is text in a spreadsheet, not a command.
    assert all(row[5].startswith("'=") for row in rows[1:])


@pytest.mark.django_db
def test_audit_needs_an_operator(viewer_client: APIClient, anon_client: APIClient,
                                 chat_key: str) -> None:  # fmt: skip
    for path in ("/api/audit", "/api/audit.csv"):
        assert viewer_client.get(path).status_code == 403
        assert anon_client.get(path).status_code in (401, 403)
        assert APIClient(HTTP_AUTHORIZATION=f"Bearer {chat_key}").get(path).status_code == 403
    viewer = Client()
    viewer.force_login(get_user_model().objects.get(username="viewer"))
    assert viewer.get("/audit/").status_code == 302  # to the login page


@pytest.mark.django_db
def test_console_page_lists_filters_and_links_the_csv(operator: Any) -> None:
    audit.record("node.approved", actor="alice", source="10.1.1.1", node_id="n7")
    audit.record("login.failed", actor="<script>x</script>")
    browser = Client()
    browser.force_login(operator)
    page = browser.get("/audit/", {"action": "node"}).content.decode()
    assert 'data-action="node.approved"' in page and "10.1.1.1" in page
    assert 'data-action="login.failed"' not in page
    assert 'href="/api/audit.csv?action=node"' in page
    everything = browser.get("/audit/").content.decode()
    assert "&lt;script&gt;" in everything and "<script>x" not in everything
    bad = browser.get("/audit/", {"to": "not-a-day"})
    assert bad.status_code == 400 and "to:" in bad.content.decode()
    # The key's row in the table never shows more than its prefix.
    _, key = keys.create_key(name="k", scopes=["chat"])
    assert key not in browser.get("/audit/").content.decode()
