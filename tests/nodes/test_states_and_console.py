"""Node state rules, the Overview page and its websocket."""

from __future__ import annotations

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client

from nodes import events
from nodes.states import NodeState, compute_state
from tests.factories import make_model, make_node, set_status


def _state(**overrides: object) -> NodeState:
    base: dict[str, object] = {
        "approved": True,
        "revoked": False,
        "enrolled": True,
        "connected": True,
        "seconds_since_contact": 1.0,
        "incompatible": False,
        "reasons": [],
    }
    base.update(overrides)
    return compute_state(**base)  # type: ignore[arg-type]


def test_state_rules() -> None:
    assert _state() == NodeState.ONLINE
    assert _state(reasons=[{"code": "model_root_low"}]) == NodeState.DEGRADED
    assert _state(seconds_since_contact=15.1) == NodeState.OFFLINE
    assert _state(seconds_since_contact=14.9) == NodeState.ONLINE
    assert _state(connected=False) == NodeState.OFFLINE
    assert _state(incompatible=True) == NodeState.INCOMPATIBLE
    assert _state(approved=False) == NodeState.PENDING_APPROVAL
    assert _state(revoked=True) == NodeState.REVOKED
    assert _state(pending_takeover=True) == NodeState.PENDING_TAKEOVER


@pytest.mark.django_db
def test_overview_needs_login_and_lists_nodes_and_counts_models(operator, status_redis) -> None:
    client = Client()
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    node = make_node("n1")
    set_status(node, "Online")
    make_model("demo", node)
    client.force_login(operator)
    page = client.get("/").content.decode()
    assert 'data-node="n1"' in page and "Online" in page and "4.0 / 10.0 GiB" in page
    assert '<meter min="0" max="100" value="40"' in page
    assert "<strong>0 / 1</strong> models Ready / placed" in page and "live.js" in page
    assert "demo" in client.get("/models/").content.decode()  # listed on the Models page


@pytest.mark.django_db(transaction=True)
async def test_fleet_websocket_forwards_typed_events(operator) -> None:
    # The session middleware would load the user; the consumer is tested on its own.
    from console.consumers import FleetConsumer

    communicator = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
    communicator.scope["user"] = operator
    connected, _ = await communicator.connect()
    assert connected
    await events.publish(_offline_event("n1"))
    received = await communicator.receive_json_from(timeout=5)
    assert received["type"] == "node.updated" and received["node"]["state"] == "Offline"
    await communicator.disconnect()


def _offline_event(node_id: str) -> events.NodeUpdated:
    return events.NodeUpdated(
        type="node.updated",
        node=events.NodeSummary(
            nodeId=node_id,
            state="Offline",
            reasons=[],
            cpuPercent=None,
            memoryPercent=None,
            memoryUsedBytes=None,
            memoryTotalBytes=None,
            lastSeen=None,
        ),
    )


@pytest.mark.django_db(transaction=True)
async def test_an_idle_fleet_websocket_outlives_the_channel_layers_blocking_wait(
    operator,
) -> None:
    # redis-py 8's default 5 s read timeout cut channels_redis's 5 s blocking receive:
    # the consumer died with redis TimeoutError after 5 idle seconds (a quiet console
    # reconnected every few seconds). Past that wait, the socket is open and live.
    from channels_redis.core import RedisChannelLayer

    from console.consumers import FleetConsumer

    communicator = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
    communicator.scope["user"] = operator
    connected, _ = await communicator.connect()
    assert connected
    assert await communicator.receive_nothing(timeout=RedisChannelLayer.brpop_timeout + 1.5)
    await events.publish(_offline_event("n2"))
    received = await communicator.receive_json_from(timeout=5)
    assert received["node"]["nodeId"] == "n2"
    await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_fleet_websocket_refuses_anonymous() -> None:
    from django.contrib.auth.models import AnonymousUser

    from console.consumers import FleetConsumer

    communicator = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
    communicator.scope["user"] = AnonymousUser()
    connected, code = await communicator.connect()
    assert not connected and code == 4401
    await communicator.disconnect()  # the consumer ends with the test's loop, not after it


@pytest.mark.django_db
def test_bundle_renewal_task_writes_and_keeps_the_bundle() -> None:
    from nodes import services, tasks

    first = tasks.renew_bootstrap_bundle()
    assert first is not None
    token = services.bundle_path().read_text()
    assert tasks.renew_bootstrap_bundle() == first
    assert services.bundle_path().read_text() == token


@pytest.mark.django_db
def test_console_add_node_and_actions(operator, viewer, status_redis) -> None:
    from nodes import services
    from nodes.models import Node

    client = Client()
    client.force_login(viewer)
    assert client.get("/nodes/add/").status_code == 302  # not staff: back to login
    client.force_login(operator)
    created = client.post("/nodes/add/", {"node_id": "gpu-1"})
    assert created.status_code == 302 and created["Location"] == "/nodes/add/"
    page = client.get("/nodes/add/").content.decode()
    assert 'id="join-token"' in page and "--node-id gpu-1" in page
    assert 'id="loopback-warning"' in page  # the default enroll URL is 127.0.0.1
    assert 'id="join-token"' not in client.get("/nodes/add/").content.decode()  # shown once
    bad = client.post("/nodes/add/", {"node_id": "Not Valid"})
    assert bad.status_code == 400 and "nodeId: use lower-case letters" in bad.content.decode()
    token = services.create_join_token(node_id="gpu-2")["token"]
    from tests.nodes.test_join import _csr

    services.enroll(token=token, node_id="gpu-2", csr_pem=_csr("gpu-2"), addresses=[])
    overview = client.get("/").content.decode()
    assert 'data-action="approve"' in overview and "PendingApproval" in overview
    assert client.post("/nodes/gpu-2/approve/").status_code == 302
    assert Node.objects.get(node_id="gpu-2").approved
    assert client.post("/nodes/gpu-2/rekey/").status_code == 302
    rekey = client.get("/nodes/add/").content.decode()
    assert "Rekey gpu-2" in rekey and "--force" in rekey and 'id="join-token"' in rekey
    assert client.post("/nodes/gpu-2/drain/").status_code == 302
    assert Node.objects.get(node_id="gpu-2").draining
    assert client.post("/nodes/gpu-2/revoke/").status_code == 302
    assert Node.objects.get(node_id="gpu-2").revoked
    assert client.get("/nodes/gpu-2/revoke/").status_code == 405
    assert client.post("/nodes/gpu-2/explode/").status_code == 404


@pytest.mark.django_db
def test_console_takeover_banner_and_action(operator, status_redis) -> None:
    import json

    from django.conf import settings

    node = make_node("n1")
    set_status(node, "PendingTakeover")
    client = Client()
    client.force_login(operator)
    assert 'id="takeover"' in client.get("/").content.decode()
    from nodes.models import MasterState

    # The node's agent cannot be reached here: takeover records it and still raises the epoch.
    assert client.post("/takeover/").status_code == 302
    assert MasterState.objects.get().epoch >= 1
    record = json.loads((settings.MIRBAD.data_path / "takeover.json").read_text())
    assert str(record["nodes"]["n1"]).startswith("unreachable")
    from nodes.models import AuditEvent

    event = AuditEvent.objects.get(action="master.takeover")
    assert event.detail["epoch"] == record["epoch"] and "n1" in event.detail["nodes"]


@pytest.mark.django_db
def test_console_shows_the_certificate_and_rotates_it(operator, status_redis) -> None:
    import datetime as dt

    from nodes.models import CertRotation

    node = make_node("n1")
    node.cert_not_after = dt.datetime(2027, 3, 1, 8, 0, tzinfo=dt.UTC)
    node.spki_pin = "a" * 44
    node.facts = {"features": ["pki.rotation"]}
    node.save()
    client = Client()
    client.force_login(operator)
    assert "until 2027-03-01 08:00 UTC" in client.get("/").content.decode()
    page = client.get("/nodes/n1/").content.decode()
    assert 'data-action="rotate"' in page
    assert client.post("/nodes/n1/rotate/").status_code == 302
    opened = CertRotation.objects.get(node=node, open=True)
    assert opened.reason == "operator"
    assert 'data-rotation="Requested"' in client.get("/").content.decode()
    again = client.post("/nodes/n1/rotate/", {"back": "node"})
    assert again.status_code == 302  # post/redirect/get: the refusal is a message
    assert "rotation open already" in client.get("/nodes/n1/").content.decode()
