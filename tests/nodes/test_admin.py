"""The Django admin: trust fields are read-only, commands are actions through nodes.services."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from models_registry.models import ModelDefinition
from nodes import audit, services, status, status_cache
from nodes.models import AuditEvent, JoinToken, Node
from router import keys
from router.models import ApiKey
from tests.factories import make_model, make_node, set_status

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client() -> Client:
    user = get_user_model().objects.create_user(
        "root", password="pw-root-1", is_staff=True, is_superuser=True
    )
    client = Client()
    client.force_login(user)
    return client


def _change_form(node: Node, **changes: Any) -> dict[str, Any]:
    """Every field the change form could carry, as a browser would post it."""
    form = {
        "node_id": node.node_id,
        "display_name": node.display_name,
        "address": node.address,
        "memory_reserve_bytes": node.memory_reserve_bytes,
        "gpu_reserves": "{}",
        "facts": "{}",
    }
    form.update(changes)
    return {k: v for k, v in form.items() if v is not False}


def _act(client: Client, url: str, action: str, *pks: int) -> Any:
    return client.post(url, {"action": action, "_selected_action": [str(p) for p in pks]})


def _pending_token(node_id: str) -> None:
    services.create_token(node_id=node_id, purpose="rekey", lifetime=dt.timedelta(hours=1))


def test_the_change_form_cannot_approve_revoke_or_repin(admin_client: Client) -> None:
    node = make_node("n1", approved=False, spki_pin="pin-n1")
    answer = admin_client.post(
        f"/admin/nodes/node/{node.pk}/change/",
        _change_form(
            node,
            display_name="rack 4",
            approved="on",
            revoked="on",
            draining="on",
            spki_pin="attacker-pin",
            node_id="other",
        ),
    )
    assert answer.status_code == 302, answer.content[:2000]
    node.refresh_from_db()
    assert node.display_name == "rack 4"  # the form itself works
    assert (node.approved, node.revoked, node.draining) == (False, False, False)
    assert (node.spki_pin, node.node_id) == ("pin-n1", "n1")


def test_approve_action_approves_through_the_service(admin_client: Client) -> None:
    enrolled = make_node("n1", approved=False, spki_pin="pin-n1")
    never = make_node("n2", approved=False, spki_pin="")
    revoked = make_node("n3", approved=False, revoked=True, spki_pin="")
    answer = _act(admin_client, "/admin/nodes/node/", "approve", enrolled.pk, never.pk, revoked.pk)
    assert answer.status_code == 302
    approved = dict(Node.objects.values_list("node_id", "approved"))
    # The service's rules hold: one never enrolled or revoked is not approved.
    assert approved == {"n1": True, "n2": False, "n3": False}
    shown = [str(m) for m in answer.wsgi_request._messages]
    assert any("n2" in m and "has not enrolled yet" in m for m in shown), shown
    assert any("n3" in m and "is revoked" in m for m in shown), shown


def test_revoke_action_does_what_the_api_does(
    admin_client: Client, operator_client: APIClient, status_redis: object
) -> None:
    by_admin = make_node("n1", pending_pin="next-n1")
    by_api = make_node("n2", pending_pin="next-n2")
    for node in (by_admin, by_api):
        _pending_token(node.node_id)
    assert _act(admin_client, "/admin/nodes/node/", "revoke", by_admin.pk).status_code == 302
    assert operator_client.post("/api/nodes/n2/revoke").status_code == 200
    for node_id in ("n1", "n2"):
        node = Node.objects.get(node_id=node_id)
        assert (node.revoked, node.spki_pin, node.pending_pin) == (True, "", "")
        assert not JoinToken.objects.filter(node_id=node_id, used_at__isnull=True).exists()
        assert status.read(node)["state"] == "Revoked"


def test_drain_actions_go_through_the_service(admin_client: Client) -> None:
    node = make_node("n1")
    _act(admin_client, "/admin/nodes/node/", "drain", node.pk)
    assert Node.objects.get(pk=node.pk).draining is True
    _act(admin_client, "/admin/nodes/node/", "undrain", node.pk)
    assert Node.objects.get(pk=node.pk).draining is False


def test_nodes_and_tokens_are_not_added_in_the_admin(admin_client: Client) -> None:
    assert admin_client.get("/admin/nodes/node/add/").status_code == 403
    assert admin_client.get("/admin/nodes/jointoken/add/").status_code == 403
    assert admin_client.get("/admin/router/apikey/add/").status_code == 403


def test_key_hash_scopes_and_revocation_are_read_only(admin_client: Client) -> None:
    row, _ = keys.create_key(name="k", scopes=["chat"])
    answer = admin_client.post(
        f"/admin/router/apikey/{row.pk}/change/",
        {
            "name": "renamed",
            "model_allowlist": "[]",
            "priority": "0",
            "budget_timezone": "UTC",
            "scopes": '["admin", "chat"]',
            "key_hash": "0" * 64,
            "revoked_at_0": "2020-01-01",
            "revoked_at_1": "00:00:00",
        },
    )
    assert answer.status_code == 302, answer.content[:2000]
    after = ApiKey.objects.get(pk=row.pk)
    assert after.name == "renamed"
    assert (after.scopes, after.key_hash, after.revoked_at) == (["chat"], row.key_hash, None)


def test_key_revoke_action_revokes_through_router_keys(admin_client: Client) -> None:
    row, key = keys.create_key(name="k", scopes=["chat"])
    assert keys.lookup(key) is not None
    _act(admin_client, "/admin/router/apikey/", "revoke", row.pk)
    assert ApiKey.objects.get(pk=row.pk).revoked_at is not None
    assert keys.lookup(key) is None


def test_desired_state_is_read_only_and_start_is_a_lifecycle_action(admin_client: Client) -> None:
    model = make_model("m1")
    form = admin_client.get(f"/admin/models_registry/modeldefinition/{model.pk}/change/")
    assert form.status_code == 200
    assert b'name="desired_state"' not in form.content
    # Unplaced: the lifecycle refuses the start (as POST /api/models/{id}/start does).
    answer = _act(admin_client, "/admin/models_registry/modeldefinition/", "start", model.pk)
    shown = [str(m) for m in answer.wsgi_request._messages]
    assert any("has no placement; place it first" in m for m in shown), shown
    assert ModelDefinition.objects.get(pk=model.pk).desired_state == "stopped"


# -- the node list: live state, search, filters (docs/decisions.md D60) -------------------


def _cell(content: bytes, node_id: str, column: str) -> str:
    """One row's cell in the changelist (the row is found by its node id link)."""
    html = content.decode()
    row = html[html.index(f">{node_id}</a>") :]
    row = row[: row.index("</tr>")]
    start = row.index(f'class="field-{column}">') + len(f'class="field-{column}">')
    return row[start : row.index("</td>", start)]


def test_the_node_list_shows_the_live_state(admin_client: Client, status_redis: object) -> None:
    online = make_node("n1")
    set_status(online, "Online")
    stale = make_node("n2")
    set_status(stale, "Online")
    make_node("n3", approved=False)
    make_node("n4", revoked=True)
    # n2's record is Online but 60 s old: the 15 s rule makes it Offline (D8).
    record = status_cache.read("n2")
    assert record is not None
    record["lastSeen"] = time.time() - 60
    status_cache.write(record)
    page = admin_client.get("/admin/nodes/node/")
    assert page.status_code == 200
    states = {n: _cell(page.content, n, "state") for n in ("n1", "n2", "n3", "n4")}
    assert states == {
        "n1": "Online",
        "n2": "Offline",
        "n3": "PendingApproval",
        "n4": "Revoked",
    }
    assert _cell(page.content, "n3", "last_seen") == "-"
    assert _cell(page.content, "n1", "last_seen") != "-"
    # The stored row says nothing of it: the state follows the cache, not a field.
    set_status(online, "Degraded")
    assert _cell(admin_client.get("/admin/nodes/node/").content, "n1", "state") == "Degraded"


def test_the_node_list_searches_and_filters(admin_client: Client) -> None:
    make_node("n1", facts={"hostname": "rack-seven"}, os="linux", arch="x86_64")
    make_node("n2", address="https://10.0.0.9:8443", os="darwin", arch="arm64", draining=True)

    def listed(query: str) -> set[str]:
        page = admin_client.get(f"/admin/nodes/node/{query}").content.decode()
        return {n for n in ("n1", "n2") if f">{n}</a>" in page}

    assert listed("?q=rack-seven") == {"n1"}  # the hostname the agent reported
    assert listed("?q=10.0.0.9") == {"n2"}
    assert listed("?os=darwin") == {"n2"}
    assert listed("?arch=x86_64") == {"n1"}
    assert listed("?draining__exact=1") == {"n2"}
    assert listed("") == {"n1", "n2"}


@pytest.mark.parametrize(
    "query",
    ["?q=%25%27%22%3Cscript%3E", "?q=%5C%5C%5C", "?q=" + "x" * 3000, "?q=%E2%80%AE%F0%9F%92%A3",
     "?approved__exact=maybe", "?o=99", "?facts__evil=1"],
)  # fmt: skip
def test_odd_node_list_queries_never_500(admin_client: Client, query: str) -> None:
    make_node("n1")
    answer = admin_client.get(f"/admin/nodes/node/{query}")
    # The admin answers an unknown filter with a redirect to ?e=1, never an error page.
    assert answer.status_code in (200, 302), answer.content[:500]


def test_the_address_must_be_an_https_agent_url(admin_client: Client) -> None:
    node = make_node("n1")
    for bad in ("http://10.0.0.1:8443", "ftp://10.0.0.1", "https://10.0.0.1:8443/agent"):
        answer = admin_client.post(
            f"/admin/nodes/node/{node.pk}/change/", _change_form(node, address=bad)
        )
        assert answer.status_code == 200  # the form again, with the error
        assert b"https://host:port" in answer.content
        assert Node.objects.get(pk=node.pk).address == node.address
    answer = admin_client.post(
        f"/admin/nodes/node/{node.pk}/change/", _change_form(node, address="https://10.0.0.1:8443")
    )
    assert answer.status_code == 302
    assert Node.objects.get(pk=node.pk).address == "https://10.0.0.1:8443"


def test_nodes_are_not_deleted_in_the_admin(admin_client: Client) -> None:
    node = make_node("n1")
    assert admin_client.get(f"/admin/nodes/node/{node.pk}/delete/").status_code == 403
    assert (
        admin_client.post(f"/admin/nodes/node/{node.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    answer = _act(admin_client, "/admin/nodes/node/", "delete_selected", node.pk)
    assert Node.objects.filter(pk=node.pk).exists()
    assert answer.status_code in (200, 302)


def test_audit_events_are_listed_searched_and_read_only(admin_client: Client) -> None:
    event = audit.record("rotation.requested", actor="alice", node_id="n1", subject="rot-1")
    audit.record("rotation.committed", actor="beat", node_id="n2", subject="rot-2")
    page = admin_client.get("/admin/nodes/auditevent/?q=alice")
    assert page.status_code == 200
    assert b"rot-1" in page.content and b"rot-2" not in page.content
    by_action = admin_client.get("/admin/nodes/auditevent/?action=rotation.committed")
    assert b"rot-2" in by_action.content and b"rot-1" not in by_action.content
    assert admin_client.get(f"/admin/nodes/auditevent/?at__year={event.at.year}").status_code == 200
    assert admin_client.get("/admin/nodes/auditevent/add/").status_code == 403
    assert (
        admin_client.post(
            f"/admin/nodes/auditevent/{event.pk}/delete/", {"post": "yes"}
        ).status_code
        == 403
    )
    # The change page only shows the record; a post changes nothing.
    admin_client.post(f"/admin/nodes/auditevent/{event.pk}/change/", {"actor": "mallory"})
    assert AuditEvent.objects.get(pk=event.pk).actor == "alice"


@pytest.mark.parametrize(
    "url",
    ["/admin/nodes/node/", "/admin/nodes/auditevent/", "/admin/nodes/jointoken/",
     "/admin/nodes/certrotation/"],
)  # fmt: skip
def test_the_node_admin_refuses_anyone_but_staff(url: str, viewer: Any, admin_key: str) -> None:
    make_node("secret-node")
    anonymous = Client().get(url)
    non_staff = Client()
    non_staff.force_login(viewer)
    for answer in (
        anonymous,
        non_staff.get(url),
        Client().get(url, HTTP_AUTHORIZATION=f"Bearer {admin_key}"),
    ):
        assert answer.status_code == 302 and answer["Location"].startswith("/admin/login/")
        assert b"secret-node" not in answer.content
    # Nor may a non-staff user run an action.
    node = Node.objects.get(node_id="secret-node")
    Node.objects.filter(pk=node.pk).update(approved=False)
    _act(non_staff, "/admin/nodes/node/", "approve", node.pk)
    assert Node.objects.get(pk=node.pk).approved is False
