"""Node labels: set through PATCH /api/nodes/{id}, allow-listed, filtered on in the lists."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from backups.document import node_record
from backups.reader import BackupInvalid, _node
from nodes import labels
from nodes.models import AuditEvent, Node
from tests.factories import make_node

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("status_redis")]


def ids(answer: Any) -> list[str]:
    assert answer.status_code == 200, answer.content
    return [n["nodeId"] for n in answer.json()["nodes"]]


def test_an_operator_sets_replaces_and_removes_labels(operator_client: APIClient) -> None:
    make_node("n1")
    answer = operator_client.patch(
        "/api/nodes/n1", {"labels": {"zone": "eu-1", "gpu": "a100", "spot": ""}}, format="json"
    )
    assert answer.status_code == 200, answer.json()
    assert answer.json()["labels"] == {"gpu": "a100", "spot": "", "zone": "eu-1"}
    event = AuditEvent.objects.get(action="node.labels_changed")
    assert event.node_id == "n1" and event.detail["after"]["gpu"] == "a100"
    replaced = operator_client.patch("/api/nodes/n1", {"labels": {"gpu": "h100"}}, format="json")
    assert replaced.json()["labels"] == {"gpu": "h100"}
    assert operator_client.get("/api/nodes/n1").json()["labels"] == {"gpu": "h100"}
    assert (
        operator_client.patch("/api/nodes/n1", {"labels": {}}, format="json").json()["labels"] == {}
    )
    # Other changes leave them alone.
    operator_client.patch("/api/nodes/n1", {"labels": {"a": "b"}}, format="json")
    operator_client.patch("/api/nodes/n1", {"memoryReserveBytes": 0}, format="json")
    assert Node.objects.get(node_id="n1").labels == {"a": "b"}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (["gpu"], "labels: must be an object"),
        ({"GPU": "x"}, "key 'GPU' is not allowed"),
        ({"gpu zone": "x"}, "key 'gpu zone' is not allowed"),
        ({"-gpu": "x"}, "is not allowed"),
        ({"k" * 64: "x"}, "is not allowed"),
        ({"gpu": "a;rm -rf"}, "labels.gpu: value 'a;rm -rf' is not allowed"),
        ({"gpu": 7}, "labels.gpu: value 'int' is not allowed"),
        ({"gpu": "v" * 64}, "is not allowed"),
        ({f"k{i}": "" for i in range(33)}, "at most 32 per node; got 33"),
    ],
)
def test_bad_labels_are_refused_naming_them_and_change_nothing(
    operator_client: APIClient, body: Any, says: str
) -> None:
    make_node("n1", labels={"kept": "yes"})
    answer = operator_client.patch("/api/nodes/n1", {"labels": body}, format="json")
    assert answer.status_code == 400, answer.json()
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and says in error["message"], error
    assert Node.objects.get(node_id="n1").labels == {"kept": "yes"}


def test_a_refused_reserve_leaves_the_labels_as_they_were(operator_client: APIClient) -> None:
    make_node("n1", labels={"kept": "yes"})
    answer = operator_client.patch(
        "/api/nodes/n1", {"labels": {"new": "x"}, "memoryReserveBytes": -1}, format="json"
    )
    assert answer.status_code == 400
    assert Node.objects.get(node_id="n1").labels == {"kept": "yes"}
    assert not AuditEvent.objects.filter(action="node.labels_changed").exists()


def test_without_permission_labels_cannot_be_set(
    viewer_client: APIClient, anon_client: APIClient
) -> None:
    make_node("n1")
    for client in (viewer_client, anon_client):
        answer = client.patch("/api/nodes/n1", {"labels": {"a": "b"}}, format="json")
        assert answer.status_code in (401, 403)
    assert Node.objects.get(node_id="n1").labels == {}


def test_the_list_filters_on_labels(operator_client: APIClient) -> None:
    make_node("a100-eu", labels={"gpu": "a100", "zone": "eu"})
    make_node("a100-us", labels={"gpu": "a100", "zone": "us"})
    make_node("h100-eu", labels={"gpu": "h100", "zone": "eu"})
    make_node("bare")
    get = operator_client.get
    assert ids(get("/api/nodes?label=gpu")) == ["a100-eu", "a100-us", "h100-eu"]
    assert ids(get("/api/nodes?label=gpu=a100")) == ["a100-eu", "a100-us"]
    assert ids(get("/api/nodes?label=gpu=a100&label=zone=eu")) == ["a100-eu"]
    assert ids(get("/api/nodes?label=gpu=a100,zone=eu")) == ["a100-eu"]
    assert ids(get("/api/nodes?label=zone=eu&state=Offline")) == ["a100-eu", "h100-eu"]
    assert ids(get("/api/nodes?label=gpu=v100")) == []
    assert get("/api/nodes?label=gpu=a100").json()["count"] == 2
    bad = get("/api/nodes?label=GPU%3Dx")
    assert bad.status_code == 400
    assert bad.json()["error"]["details"]["field"] == "label"
    assert "key or key=value" in bad.json()["error"]["message"]


def test_the_nodes_page_filters_on_labels_and_shows_them(operator: Any) -> None:
    client = Client()
    client.force_login(operator)
    make_node("a100-eu", labels={"gpu": "a100", "zone": "eu"})
    make_node("h100-eu", labels={"gpu": "h100"})
    page = client.get("/nodes/?label=gpu%3Da100").content.decode()
    assert 'data-node="a100-eu"' in page and 'data-node="h100-eu"' not in page
    assert '<small class="labels">gpu=a100 zone=eu</small>' in page
    assert 'name="label" id="node-label" value="gpu=a100"' in page
    refused = client.get("/nodes/?label=%3Bdrop")
    assert refused.status_code == 400 and "label: key or key=value" in refused.content.decode()


def test_labels_go_into_a_backup_and_bad_ones_are_refused_on_reading() -> None:
    node = make_node("n1", labels={"gpu": "a100"})
    record = node_record(node)
    assert record["labels"] == {"gpu": "a100"}
    assert _node(record, "$.nodes[0]")["labels"] == {"gpu": "a100"}
    assert _node({k: v for k, v in record.items() if k != "labels"}, "$.n")["labels"] == {}
    with pytest.raises(BackupInvalid) as refused:
        _node({**record, "labels": {"gpu": "a b"}}, "$.nodes[0]")
    assert refused.value.path == "$.nodes[0].labels" and "is not allowed" in refused.value.message


def test_selectors_and_matching() -> None:
    assert labels.parse_selectors({"label": " gpu=a100  zone "}) == (
        ("gpu", "a100"),
        ("zone", None),
    )
    assert labels.parse_selectors({"label": "spot="}) == (("spot", ""),)
    assert labels.matches({"spot": ""}, (("spot", ""),))
    assert not labels.matches({"spot": "yes"}, (("spot", ""),))
    assert not labels.matches(None, (("gpu", None),))
    assert labels.text({"zone": "eu", "spot": ""}) == "spot zone=eu"
