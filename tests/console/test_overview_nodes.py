"""The Overview reads every node as plain values and builds a Node only for the rows it
shows (console.views._read_nodes, issue 19): those rows, the node states of its tiles and
its Needs attention lines must be what the Node instances of the Nodes page give."""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from console import node_views, views
from nodes import listing
from nodes import status as node_status
from nodes.models import CertRotation, Node
from tests.factories import make_node, set_status


def _fleet() -> None:
    """Nodes in every registry situation a row or a state reads."""
    soon = timezone.now() + datetime.timedelta(minutes=30)
    held = make_node(
        "a-held",
        display_name="Rack 4",
        maintenance_until=soon,
        maintenance_reason="bios <update>",
        os="Linux",
        arch="x86_64",
        agent_version="0.9.0",
        protocol_version=1,
        cert_not_after=soon + datetime.timedelta(days=30),
    )
    over = make_node("b-hold-over", maintenance_until=timezone.now() - datetime.timedelta(hours=1))
    draining = make_node("c-draining", draining=True, cert_renewal_error="CA refused")
    rotating = make_node("d-rotating")
    CertRotation.objects.create(node=rotating, rotation_id="r" * 44, reason="scheduled")
    make_node("e-waiting", approved=False)
    make_node("f-revoked", revoked=True)
    make_node("g-silent")  # no status record: Offline
    for node in (held, over, draining, rotating):
        set_status(node)


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis")
def test_the_overview_rows_are_the_nodes_pages_rows(operator: Any) -> None:
    _fleet()
    loaded = list(Node.objects.order_by("node_id").only(*node_views.ROW_FIELDS))
    listing.attach_open_rotations(loaded)
    statuses = node_status.read_many(loaded)

    facts = views._read_nodes()
    assert [f.node_id for f in facts] == [n.node_id for n in loaded]
    for fact, node in zip(facts, loaded, strict=True):
        built = fact.node()
        assert built.get_deferred_fields() == node.get_deferred_fields()
        for name in ("pk", *node_views.ROW_FIELDS):
            assert getattr(built, name) == getattr(node, name), name
        assert built.open_rotations == node.open_rotations  # type: ignore[attr-defined]
        assert fact.maintenance_left() == pytest.approx(node.maintenance_left(), abs=1.0)
    for node_id, status in node_status.read_many(facts).items():
        assert status["state"] == statuses[node_id]["state"]
        left = statuses[node_id]["maintenanceLeft"]
        assert status["maintenanceLeft"] == pytest.approx(left, abs=1.0)

    fleet = views._fleet()
    rows = node_views.rows_for(loaded, statuses)
    for row in (*fleet["nodes"], *rows):
        row.pop("last_seen_age", None)  # "3 s ago": the clock moved between the two
    assert fleet["nodes"] == rows
    states = dict(fleet["tiles"]["nodes_by_state"])
    assert states == {"Online": 4, "Offline": 1, "PendingApproval": 1, "Revoked": 1}

    client = Client()
    client.force_login(operator)
    page = client.get("/overview/summary/").content.decode()
    section = page.split('<section id="attention">', 1)[1]
    subjects = re.findall(r'<li data-kind="[a-z]+"><a href="[^"]*">([^<]*)</a>', section)
    # The hold does not make a line; the open rotation, the failed renewal, the waiting
    # and the silent node do; a revoked node never.
    assert subjects == ["c-draining", "d-rotating", "e-waiting", "g-silent"]
