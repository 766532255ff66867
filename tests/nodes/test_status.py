"""One effective node status (nodes.status), and every reader showing the same one."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from core.errors import ServiceError
from models_registry import lifecycle
from models_registry import services as model_services
from nodes import status, status_cache
from nodes.models import Node
from nodes.status_cache import NodeStatus
from router import routing
from router.errors import V1Error
from tests.factories import make_model, make_node, set_status

NOW = 1_000_000.0


def _record(state: str = "Online", seen_ago: float | None = 1.0) -> NodeStatus:
    return {
        "nodeId": "n1",
        "state": state,
        "reasons": [],
        "lastSeen": None if seen_ago is None else NOW - seen_ago,
        "instances": {"i1": {"state": "Ready"}},
    }


def _node(**fields: object) -> Node:
    return Node(node_id="n1", **{"approved": True, **fields})


@pytest.mark.parametrize(
    ("node_fields", "record", "expected"),
    [
        ({}, _record(), "Online"),
        ({}, _record("Degraded"), "Degraded"),
        # the 15 s rule: a dead monitor leaves the record Online; the reader does not
        ({}, _record(seen_ago=15.1), "Offline"),
        ({}, _record(seen_ago=14.9), "Online"),
        ({}, _record(seen_ago=None), "Offline"),
        ({}, None, "Offline"),
        # states that are not serving keep their name, however old
        ({}, _record("Incompatible", seen_ago=60), "Incompatible"),
        ({}, _record("PendingTakeover", seen_ago=60), "PendingTakeover"),
        ({}, _record("Unknown", seen_ago=None), "Unknown"),
        # the registry decides first, whatever the record says
        ({"revoked": True}, _record(), "Revoked"),
        ({"approved": False}, _record(), "PendingApproval"),
        ({"approved": False, "revoked": True}, None, "Revoked"),
    ],
)
def test_the_effective_state(node_fields: dict, record: NodeStatus | None, expected: str) -> None:
    assert status.effective(_node(**node_fields), record, now=NOW)["state"] == expected


def test_a_last_known_copy_is_judged_as_of_its_read() -> None:
    # Redis stalled 60 s ago: the copy read then was fresh then, so /v1 keeps serving.
    copy = _record(seen_ago=70)
    copy["statusSource"] = status_cache.LAST_KNOWN
    copy["statusAsOf"] = NOW - 65
    assert status.effective(_node(), copy, now=NOW)["state"] == "Online"
    copy["statusAsOf"] = NOW - 50  # read when its lastSeen was 20 s old: Offline then
    assert status.effective(_node(), copy, now=NOW)["state"] == "Offline"


def test_the_record_is_not_changed_and_the_hold_is_carried() -> None:
    record = _record(seen_ago=30)
    held = _node(maintenance_until=timezone.now() + dt.timedelta(seconds=100))
    answer = status.effective(held, record, now=NOW)
    assert record["state"] == "Online" and "maintenanceLeft" not in record
    assert answer["state"] == "Offline" and 99 < answer["maintenanceLeft"] <= 100
    assert answer["instances"] == record["instances"]


def test_serving_and_taking_traffic() -> None:
    online = status.effective(_node(), _record(), now=NOW)
    assert status.is_serving(online) and status.takes_traffic(online)
    held = _node(maintenance_until=timezone.now() + dt.timedelta(seconds=100))
    on_hold = status.effective(held, _record(), now=NOW)
    # A hold keeps the node serving (a benchmark starts models on it) but takes it out of /v1.
    assert status.is_serving(on_hold) and not status.takes_traffic(on_hold)
    for state in ("Offline", "Incompatible", "PendingTakeover", "Unknown", "Revoked"):
        assert not status.is_serving({"nodeId": "n1", "state": state})
    assert not status.is_serving(None)


@pytest.mark.django_db
def test_the_refusal_names_the_effective_state(status_redis: object) -> None:
    node = make_node("n1")
    with pytest.raises(ServiceError) as caught:
        status.require_serving(node, "the model cannot start now")
    assert (caught.value.status, caught.value.code) == (503, "node_not_serving")
    assert caught.value.message == (
        "Node n1 is not serving (state: Offline); the model cannot start now."
    )
    set_status(node, "Online")
    assert status.require_serving(node, "x")["state"] == "Online"


def _stale_online(node: Node, instance_id: str) -> None:
    """The monitor died 20 s ago with the node Online and its replica Ready."""
    status_cache.write(
        {
            "nodeId": node.node_id,
            "state": "Online",
            "reasons": [],
            "lastSeen": time.time() - 20,
            "instances": {instance_id: {"state": "Ready", "modelId": 1}},
        }
    )


@pytest.mark.django_db
def test_every_reader_shows_the_same_state(
    operator: object, operator_client: APIClient, status_redis: object
) -> None:
    """The API, the console, model rows, model commands and the router agree."""
    stale = make_node("stale")
    revoked = make_node("gone")
    models = {}
    for node in (stale, revoked):
        model = make_model(f"m-{node.node_id}", node)
        models[node.node_id] = model
        _stale_online(node, model.placements.get().instance_id)
    # The cache of the revoked one is fresh (the monitor was not told yet): the registry wins.
    set_status(revoked, "Online", {models["gone"].placements.get().instance_id: {"state": "Ready"}})
    Node.objects.filter(pk=revoked.pk).update(revoked=True)
    expected = {"stale": "Offline", "gone": "Revoked"}

    api = {n["nodeId"]: n["state"] for n in operator_client.get("/api/nodes").json()["nodes"]}
    assert api == expected
    client = Client()
    client.force_login(operator)  # type: ignore[arg-type]
    page = client.get("/").content.decode()
    for node_id, state in expected.items():
        row = page.split(f'data-node="{node_id}"')[1].split("</tr>")[0]
        assert f"s-{state}" in row, row
    for node_id, model in models.items():
        node = Node.objects.get(node_id=node_id)
        statuses = status.read_many([node])
        assert statuses[node_id]["state"] == expected[node_id]
        # A replica on a node that is not serving is Offline, whatever its record says.
        assert model_services.model_state(model, statuses)["state"] == "Offline"
        listed = operator_client.get(f"/api/models/{model.pk}").json()
        assert listed["state"] == "Offline", listed
    with pytest.raises(ServiceError) as caught:
        lifecycle.check_node_for_start(Node.objects.get(node_id="stale"))
    assert "(state: Offline)" in caught.value.message


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis")
async def test_the_router_applies_the_same_rule() -> None:
    from asgiref.sync import sync_to_async

    node = await sync_to_async(make_node)("stale")
    model = await sync_to_async(make_model)("m", node)
    instance_id = await sync_to_async(lambda: model.placements.get().instance_id)()
    await sync_to_async(_stale_online)(node, instance_id)
    route = routing.Route(
        model_id=model.pk,
        served_name="m",
        replicas=(routing.Replica(node=node, instance_id=instance_id),),
    )
    with pytest.raises(V1Error) as caught:
        await routing.RoutingTable().pick(route)
    assert caught.value.code == "node_offline"
