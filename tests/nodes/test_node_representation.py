"""A node on the wire, built directly (issue 19): the same answer as DRF's rendering of
NodeSerializer's declared fields, and the unfiltered list reads each node row once."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework import serializers
from rest_framework.test import APIClient

from nodes import status as node_status
from nodes.api.serializers import NodeSerializer, node_representation
from nodes.models import CertRotation, Node
from nodes.status_cache import LAST_KNOWN, NodeStatus
from tests.factories import make_node, set_status

pytestmark = pytest.mark.django_db


def _generic(node: Node, status: NodeStatus) -> dict[str, Any]:
    """What DRF writes field by field from the declared fields (the schema)."""
    serializer = NodeSerializer(context={"statuses": {node.node_id: status}})
    return dict(serializers.Serializer.to_representation(serializer, node))


def _nodes() -> list[Node]:
    plain = make_node("plain", spki_pin="")
    rich = make_node(
        "rich",
        display_name="Rack 7",
        is_bootstrap=True,
        os="Linux",
        arch="x86_64",
        agent_version="0.9.0",
        memory_total_bytes=64 * 2**30,
        gpu_reserves={"GPU-1": 2**30, "GPU-9": 5},
        facts={"gpus": [{"uuid": "GPU-1"}, {"uuid": "GPU-2"}, "junk"], "executables": []},
        cert_not_after=timezone.now() + datetime.timedelta(days=30),
        maintenance_until=timezone.now() + datetime.timedelta(hours=1),
        maintenance_reason="disk swap",
        draining=True,
    )
    CertRotation.objects.create(node=rich, rotation_id="r" * 44, reason="expiring")
    ended = make_node(
        "ended",
        revoked=True,
        maintenance_until=timezone.now() - datetime.timedelta(hours=1),
        facts={},
    )
    return [plain, rich, ended]


def _statuses() -> list[NodeStatus]:
    live: NodeStatus = {
        "nodeId": "x",
        "state": "Degraded",
        "reasons": [{"code": "clock_skew", "message": "40 s"}],
        "lastSeen": time.time(),
        "lastError": "boom",
        "fencing": {"epoch": 3},
        "bootId": "b-1",
        "instances": {"i-1": {"instanceId": "i-1", "state": "Ready"}},
        "telemetry": {"cpuPercent": 3.0, "gpus": [{"index": 0}]},
    }
    last_known: NodeStatus = {
        "nodeId": "x",
        "state": "Online",
        "reasons": [],
        "lastSeen": None,
        "statusSource": LAST_KNOWN,
        "statusAsOf": 1234.5,
    }
    return [live, last_known, {}]


def test_the_direct_representation_is_drf_s_rendering_of_the_declared_fields() -> None:
    nodes = _nodes()
    # The list's way (one query for the open rotations) and the single node's (its own).
    node_status.read_many(nodes)  # a warm read, as the views make
    from nodes import listing

    listing.attach_open_rotations(nodes)
    for node in [*nodes, *Node.objects.order_by("node_id")]:
        for record in _statuses():
            status = node_status.effective(node, record) if record else {}
            assert node_representation(node, status) == _generic(node, status)
            assert list(node_representation(node, status)) == list(_generic(node, status))


def test_the_list_and_the_single_node_answer_the_same_node(
    operator_client: APIClient, status_redis: object
) -> None:
    nodes = _nodes()
    set_status(nodes[1], "Online")
    listed = {n["nodeId"]: n for n in operator_client.get("/api/nodes").json()["nodes"]}
    for node in nodes:
        single = operator_client.get(f"/api/nodes/{node.node_id}").json()
        single.pop("maintenance")  # secondsLeft counts down between the two reads
        listed[node.node_id].pop("maintenance")
        assert listed[node.node_id] == single


def test_the_unfiltered_list_reads_each_node_row_once(
    operator_client: APIClient, status_redis: object
) -> None:
    for i in range(5):
        make_node(f"n{i}")
    with CaptureQueriesContext(connection) as captured:
        body = operator_client.get("/api/nodes", {"limit": 3, "offset": 1}).json()
    assert [n["nodeId"] for n in body["nodes"]] == ["n1", "n2", "n3"]
    assert body["count"] == 5 and body["next"] == 4
    node_rows = [
        q["sql"]
        for q in captured.captured_queries
        if 'FROM "nodes_node"' in q["sql"] and "COUNT(" not in q["sql"].upper()
    ]
    # Before issue 19: every node's filter columns, then the page's rows again, whole.
    assert len(node_rows) == 1, node_rows


def test_the_list_s_plain_values_answer_as_the_node_does() -> None:
    """GET /api/nodes builds no Node (nodes.listing.NodeValues, issue 19): each row of
    values answers what its Node answers, key for key and in the same order."""
    from nodes import listing

    _nodes()
    nodes = list(Node.objects.order_by("node_id"))
    listing.attach_open_rotations(nodes)
    rows = listing.node_values(Node.objects.order_by("node_id"))
    listing.attach_open_rotations(rows)
    assert [r.node_id for r in rows] == [n.node_id for n in nodes]
    now = time.time()
    for node, row in zip(nodes, rows, strict=True):
        assert row.enrolled == node.enrolled and row.gpu_reserve("GPU-1") == node.gpu_reserve(
            "GPU-1"
        )
        for record in _statuses():
            as_node = node_status.effective(node, record, now) if record else {}
            as_values = node_status.effective(row, record, now) if record else {}
            assert as_values.keys() == as_node.keys()
            as_values["maintenanceLeft"] = as_node.get("maintenanceLeft", 0.0)  # the clock moved
            expected = node_representation(node, as_node)
            answered = node_representation(row, as_values)
            for answer in (expected, answered):
                if answer["maintenance"]:
                    answer["maintenance"].pop("secondsLeft")  # the clock moved
            assert answered == expected
            assert list(answered) == list(expected)
