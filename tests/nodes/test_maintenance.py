"""Maintenance holds: the API that sets and ends them, and /v1 routing around them."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from nodes.models import Node
from router import routing
from router.errors import V1Error
from tests.factories import make_node


@pytest.mark.django_db
def test_hold_and_end_through_the_api(operator_client: APIClient) -> None:
    make_node("a")
    held = operator_client.post(
        "/api/nodes/a/maintenance", {"seconds": 900, "reason": "benchmark"}, format="json"
    )
    assert held.status_code == 200, held.json()
    shown = held.json()["maintenance"]
    assert shown["reason"] == "benchmark" and 890 <= shown["secondsLeft"] <= 900
    assert operator_client.get("/api/nodes/a").json()["maintenance"]["reason"] == "benchmark"
    ended = operator_client.delete("/api/nodes/a/maintenance")
    assert ended.status_code == 200 and ended.json()["maintenance"] is None
    assert Node.objects.get(node_id="a").maintenance_until is None
    # Ending twice is not an error: the node is simply not held.
    assert operator_client.delete("/api/nodes/a/maintenance").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({}, "seconds"),
        ({"seconds": "600"}, "seconds"),
        ({"seconds": True}, "seconds"),
        ({"seconds": 0}, "out of range"),
        ({"seconds": 8 * 24 * 3600}, "out of range"),
        ({"seconds": 60, "reason": 5}, "reason"),
        ({"seconds": 60, "reason": "x" * 201}, "reason"),
        ({"seconds": 60, "until": "later"}, "until"),
    ],
)
def test_bad_holds_are_refused_naming_the_field(
    operator_client: APIClient, body: dict, names: str
) -> None:
    make_node("a")
    answer = operator_client.post("/api/nodes/a/maintenance", body, format="json")
    assert answer.status_code == 400
    assert names in answer.json()["error"]["message"]
    assert Node.objects.get(node_id="a").maintenance_until is None


@pytest.mark.django_db
def test_unknown_node_is_404(operator_client: APIClient) -> None:
    answer = operator_client.post("/api/nodes/zz/maintenance", {"seconds": 60}, format="json")
    assert answer.status_code == 404


@pytest.mark.django_db
def test_viewer_cannot_hold_a_node(viewer_client: APIClient) -> None:
    make_node("a")
    answer = viewer_client.post("/api/nodes/a/maintenance", {"seconds": 60}, format="json")
    assert answer.status_code == 403
    assert Node.objects.get(node_id="a").maintenance_until is None


def _route(*nodes: Node) -> routing.Route:
    replicas = tuple(routing.Replica(node=n, instance_id=f"i-{n.node_id}") for n in nodes)
    return routing.Route(model_id=1, served_name="m", replicas=replicas)


def _ready_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    async def aread(node_id: str) -> dict:
        return {
            "nodeId": node_id,
            "state": "Online",
            "lastSeen": time.time(),  # a record the 15 s rule (nodes.status) keeps Online
            "instances": {f"i-{node_id}": {"state": "Ready"}},
        }

    monkeypatch.setattr(routing.status_cache, "aread", aread)


async def test_a_held_node_gets_no_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    _ready_everywhere(monkeypatch)
    held = Node(
        node_id="a", approved=True, maintenance_until=timezone.now() + dt.timedelta(minutes=5)
    )
    free = Node(node_id="b", approved=True)
    table = routing.RoutingTable()
    picks = {(await table.pick(_route(held, free))).node.node_id for _ in range(20)}
    assert picks == {"b"}


async def test_all_replicas_held_is_503_maintenance_with_the_time_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _ready_everywhere(monkeypatch)
    now = timezone.now()
    a = Node(
        node_id="a",
        maintenance_until=now + dt.timedelta(seconds=600),
        maintenance_reason="tune",
    )
    b = Node(node_id="b", maintenance_until=now + dt.timedelta(seconds=120.5))
    table = routing.RoutingTable()
    with pytest.raises(V1Error) as caught:
        await table.pick(_route(a, b))
    error = caught.value
    assert error.status == 503 and error.code == "maintenance"
    assert 119 <= error.retry_after <= 121  # the hold that ends first
    assert "'b'" in error.message
    with pytest.raises(V1Error) as caught:
        await table.pick(_route(a))
    assert "(tune)" in caught.value.message and 599 <= caught.value.retry_after <= 600


async def test_a_hold_that_ran_out_routes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    _ready_everywhere(monkeypatch)
    over = Node(
        node_id="a", approved=True, maintenance_until=timezone.now() - dt.timedelta(seconds=1)
    )
    table = routing.RoutingTable()
    assert (await table.pick(_route(over))).node.node_id == "a"
