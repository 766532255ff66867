"""The console's node page (issue 13's part: the certificate, the open rotation, the
audit log, live over ``/ws/nodes/<id>/``)."""

from __future__ import annotations

import datetime as dt

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from nodes import events, rotation
from nodes.models import CertRotation
from tests.channels_catcher import Catcher
from tests.factories import make_node, set_status


def _rotatable(node_id: str = "n1"):  # type: ignore[no-untyped-def]
    node = make_node(node_id)
    node.cert_not_after = dt.datetime(2027, 3, 1, 8, 0, tzinfo=dt.UTC)
    node.cert_serial = "5eed"
    node.spki_pin = "a" * 44
    node.facts = {"features": ["pki.rotation"]}
    node.save()
    return node


@pytest.mark.django_db
def test_the_node_page_needs_an_operator(viewer, status_redis) -> None:
    _rotatable()
    client = Client()
    assert client.get("/nodes/n1/")["Location"].startswith("/login/")
    client.force_login(viewer)  # not staff: the console is for operators
    assert client.get("/nodes/n1/")["Location"].startswith("/login/")


@pytest.mark.django_db
def test_the_node_page_shows_the_certificate_rotation_and_audit(operator, status_redis) -> None:
    node = _rotatable()
    set_status(node, "Online")
    client = Client()
    client.force_login(operator)
    assert client.get("/nodes/nope/").status_code == 404
    page = client.get("/nodes/n1/").content.decode()
    assert 'data-ws="/ws/nodes/n1/"' in page and "Online" in page
    assert 'id="cert-serial">5eed<' in page
    assert 'id="cert-not-after">2027-03-01 08:00 UTC<' in page
    due = rotation.renew_at(node)
    assert due is not None and f'id="cert-renew-at">{due:%Y-%m-%d %H:%M} UTC<' in page
    assert 'id="rotation-stage">none<' in page and "No rotations yet." in page
    # Rotate from the page: back to the page, which shows the stage and the audit.
    answer = client.post("/nodes/n1/rotate/", {"back": "node"})
    assert answer.status_code == 302 and answer["Location"] == "/nodes/n1/"
    opened = CertRotation.objects.get(node=node, open=True)
    page = client.get("/nodes/n1/").content.decode()
    assert f'id="rotation-stage">Requested ({opened.rotation_id}, operator)<' in page
    assert 'data-rotation="Requested"' in page and "rotation.requested" in page
    # The Overview links the node to its page and shows the same certificate cell.
    overview = client.get("/").content.decode()
    assert '<a href="/nodes/n1/">n1</a>' in overview
    assert "until 2027-03-01 08:00 UTC" in overview and 'data-rotation="Requested"' in overview


@pytest.mark.django_db(transaction=True)
async def test_each_stored_stage_is_published_to_the_fleet_and_the_node(operator) -> None:
    await sync_to_async(_rotatable)()
    async with Catcher(events.FLEET_GROUP, events.node_group("n1")) as catcher:
        opened = await sync_to_async(rotation.request_rotation)("n1")
        got = [m["event"] for m in await catcher.drain()]
    published = [e for e in got if e["type"] == "node.certificate"]
    # One event, sent to both groups (the one channel joined both).
    assert len(published) == 2 and published[0] == published[1]
    cert = published[0]["certificate"]
    assert cert["nodeId"] == "n1" and cert["serial"] == "5eed"
    assert cert["notAfter"] == "2027-03-01T08:00:00+00:00"
    assert cert["rotation"]["rotationId"] == opened.rotation_id
    assert cert["rotation"]["stage"] == "Requested"


@pytest.mark.django_db(transaction=True)
async def test_the_node_websocket_forwards_that_nodes_events_only(operator) -> None:
    from django.contrib.auth.models import AnonymousUser

    from console.consumers import NodeConsumer

    def socket(path: str, user: object) -> WebsocketCommunicator:
        node_id = path.split("/")[3]
        communicator = WebsocketCommunicator(NodeConsumer.as_asgi(), path)
        communicator.scope["user"] = user
        communicator.scope["url_route"] = {"kwargs": {"node_id": node_id}}
        return communicator

    anonymous = socket("/ws/nodes/n1/", AnonymousUser())
    connected, code = await anonymous.connect()
    assert not connected and code == 4401
    await anonymous.disconnect()  # the consumer ends with the test's loop, not after it
    invalid = socket("/ws/nodes/N_1!/", operator)
    connected, code = await invalid.connect()
    assert not connected and code == 4404
    await invalid.disconnect()

    mine = socket("/ws/nodes/n1/", operator)
    connected, _ = await mine.connect()
    assert connected
    summary = events.CertificateSummary(nodeId="n2", serial="1", notAfter=None, renewAt=None,
                                        renewalError="", rotation=None)  # fmt: skip
    await events.publish(events.CertificateUpdated(type="node.certificate", certificate=summary))
    assert await mine.receive_nothing(timeout=0.5)  # another node's event
    summary["nodeId"] = "n1"
    await events.publish(events.CertificateUpdated(type="node.certificate", certificate=summary))
    received = await mine.receive_json_from(timeout=5)
    assert received["type"] == "node.certificate" and received["certificate"]["nodeId"] == "n1"
    await mine.disconnect()
