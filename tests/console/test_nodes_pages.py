"""The Nodes list, the row fragment live.js swaps in, the node page's current block and
history, the Overview's tiles and Needs attention, and node actions as post/redirect/get."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import Client

from nodes import status_cache, telemetry
from nodes.models import Node
from tests.factories import make_model, make_node, set_status
from tests.telemetry_support import history

__all__ = ["history"]  # the fixture, imported to be used

PAGES = [
    "/nodes/",
    "/nodes/n1/row/",
    "/nodes/n1/current/",
    "/nodes/n1/history.json",
    "/overview/summary/",
]


def _status(node: Node, **fields: Any) -> None:
    record: status_cache.NodeStatus = {
        "nodeId": node.node_id,
        "state": "Online",
        "reasons": [],
        "lastSeen": time.time(),
        "instances": {},
        "telemetry": {
            "cpuPercent": 37.0,
            "cpuPerCore": [30.0, 44.0],
            "load": [0.5, 0.4, 0.3],
            "memory": {"percent": 25.0, "usedBytes": 2 * 2**30, "totalBytes": 8 * 2**30},
            "disks": [{"path": "/srv/models", "totalBytes": 100 * 2**30, "freeBytes": 60 * 2**30}],
            "gpus": [
                {
                    "index": 0,
                    "name": "RTX",
                    "memoryTotalBytes": 16 * 2**30,
                    "memoryUsedBytes": 4 * 2**30,
                }
            ],
        },
    }
    record.update(fields)  # type: ignore[typeddict-item]
    status_cache.write(record)


@pytest.fixture
def client(operator) -> Client:  # type: ignore[no-untyped-def]
    c = Client()
    c.force_login(operator)
    return c


@pytest.mark.django_db
@pytest.mark.parametrize("url", PAGES)
def test_each_page_needs_an_operator(url: str, viewer, status_redis) -> None:  # type: ignore[no-untyped-def]
    make_node("n1")
    anonymous = Client()
    assert anonymous.get(url)["Location"].startswith("/login/")
    anonymous.force_login(viewer)  # signed in, but not staff
    assert anonymous.get(url)["Location"].startswith("/login/")


@pytest.mark.django_db
def test_the_nodes_list_shows_every_column(client: Client, status_redis) -> None:
    node = make_node("n1", os="Linux", arch="x86_64", agent_version="0.9.1", protocol_version=1)
    node.draining = True
    node.save()
    _status(node)
    model = make_model("m1", node=node)
    placement = model.placements.get()
    _status(node, instances={placement.instance_id: {"state": "Ready"}})
    page = client.get("/nodes/").content.decode()
    row = re.search(r'<tr data-node="n1".*?</tr>', page, re.S)
    assert row is not None
    html = row.group(0)
    assert 'class="badge s-Online"' in html and "Draining" in html
    assert "Linux · x86_64" in html and node.address in html
    assert 'value="37"' in html and "2.0 / 8.0 GiB" in html  # CPU and RAM bars
    assert "GPU 0: " in html and "4.0 / 16.0 GiB" in html
    assert '<td class="models">1 / 1</td>' in html
    assert "0.9.1 · v1" in html and "s ago" in html
    assert 'class="stale"' not in html


@pytest.mark.django_db
def test_an_offline_node_shows_its_last_values_greyed_with_their_age_and_error(
    client: Client, status_redis
) -> None:
    node = make_node("n1")
    _status(node, lastSeen=time.time() - 600, lastError="connect refused: 10.0.0.7:9443")
    html = client.get("/nodes/").content.decode()
    row = re.search(r'<tr data-node="n1".*?</tr>', html, re.S)
    assert row is not None
    assert 'class="stale"' in row.group(0) and "s-Offline" in row.group(0)
    assert "10 min ago" in row.group(0) and "values as of" in row.group(0)
    assert "connect refused: 10.0.0.7:9443" in row.group(0)
    current = client.get("/nodes/n1/current/").content.decode()
    assert 'class="stale"' in current and "values below are not current" in current
    assert "connect refused" in current and "0.5 · 0.4" not in current  # no load as current


@pytest.mark.django_db
def test_search_and_filters(client: Client, status_redis) -> None:
    a, b = make_node("gpu-a"), make_node("cpu-b")
    set_status(a, "Online")
    b.draining = True
    b.save()
    pending = make_node("new-c")
    pending.approved = False
    pending.save()
    page = client.get("/nodes/", {"q": "GPU"}).content.decode()
    assert 'data-node="gpu-a"' in page and 'data-node="cpu-b"' not in page
    page = client.get("/nodes/", {"show": "draining"}).content.decode()
    assert 'data-node="cpu-b"' in page and 'data-node="gpu-a"' not in page
    page = client.get("/nodes/", {"show": "pending"}).content.decode()
    assert 'data-node="new-c"' in page and 'data-node="cpu-b"' not in page
    page = client.get("/nodes/", {"show": "attention"}).content.decode()
    assert 'data-node="cpu-b"' in page and 'data-node="gpu-a"' not in page  # offline
    odd = client.get("/nodes/", {"show": "<script>", "q": "x" * 5000})
    assert odd.status_code == 200
    assert "Unknown filter" in odd.content.decode() and "<script>" not in odd.content.decode()
    assert client.get("/nodes/", {"q": "zzz"}).content.decode().count("No node matches.") == 1


@pytest.mark.django_db
def test_the_row_fragment_is_the_row_of_the_list(client: Client, status_redis) -> None:
    node = make_node("n1")
    node.approved = False
    node.spki_pin = "Q" * 43 + "="
    node.save()
    page = client.get("/nodes/").content.decode()
    fragment = client.get("/nodes/n1/row/").content.decode().strip()
    listed = re.search(r'<tr data-node="n1".*?</tr>', page, re.S)
    assert listed is not None
    unmasked = re.compile(r'name="csrfmiddlewaretoken" value="[^"]*"')  # masked per render
    assert unmasked.sub("", listed.group(0)) == unmasked.sub("", fragment)
    # The full fingerprint sits beside the Approve button (not cut to 12 characters).
    assert f"SHA256:{'Q' * 43}=" in fragment and 'data-action="approve"' in fragment
    assert client.get("/nodes/nope/row/").status_code == 404


@pytest.mark.django_db
def test_the_node_page_shows_current_telemetry_engines_and_its_actions(
    client: Client, status_redis
) -> None:
    node = make_node("n1")
    model = make_model("m1", node=node)
    instance = model.placements.get().instance_id
    _status(node, instances={instance: {"state": "Ready"}})
    page = client.get("/nodes/n1/").content.decode()
    assert "0.5 · 0.4 · 0.3" in page and 'class="core"' in page  # load and each core
    assert "/srv/models" in page and "40.0 / 100.0 GiB" in page  # the disk, used of total
    assert f'data-instance="{instance}"' in page and "/models/" in page
    assert 'id="charts" data-src="/nodes/n1/history.json"' in page
    for action in ("drain", "rotate", "rekey", "revoke", "maintenance"):
        assert f'data-action="{action}"' in page


@pytest.mark.django_db
@pytest.mark.usefixtures("history")
def test_history_json_serves_the_recorded_points(client: Client, status_redis) -> None:
    node = make_node("n1")
    now = time.time()
    for i in range(3):
        sample = {"cpuPercent": 10.0 + i, "memory": {"usedBytes": 1, "totalBytes": 2}}
        async_to_sync(telemetry.arecord)(node.node_id, sample, now=now - 10 + 5 * i)
    body = client.get("/nodes/n1/history.json").json()
    assert [p["cpu"] for p in body["points"] if p["cpu"] is not None] == [10.0, 11.0, 12.0]
    assert client.get("/nodes/n1/history.json", {"window": "24h"}).status_code == 200
    bad = client.get("/nodes/n1/history.json", {"window": "7d"})
    assert bad.status_code == 400 and "window" in bad.json()["error"]["message"]
    assert client.get("/nodes/zz/history.json").status_code == 404


@pytest.mark.django_db
def test_the_overview_has_tiles_and_needs_attention(client: Client, status_redis) -> None:
    up, down = make_node("up"), make_node("down")
    set_status(up, "Online")
    _status(down, lastSeen=time.time() - 120, lastError="read timeout")
    pending = make_node("new")
    pending.approved = False
    pending.save()
    page = client.get("/").content.decode()
    assert 'id="tile-nodes"' in page and "1 Online" in page and "1 Offline" in page
    attention = re.search(r'<section id="attention">.*?</section>', page, re.S)
    assert attention is not None
    text = attention.group(0)
    assert 'href="/nodes/down/"' in text and "Offline" in text and "read timeout" in text
    assert 'href="/nodes/new/"' in text and "Waiting for approval" in text
    assert 'href="/nodes/up/"' not in text
    summary = client.get("/overview/summary/").content.decode()
    assert 'id="tiles"' in summary and 'id="attention"' in summary and "read timeout" in summary


@pytest.mark.django_db
def test_node_actions_redirect_with_a_message(client: Client, status_redis) -> None:
    make_node("n1")
    answer = client.post("/nodes/n1/maintenance/", {"minutes": "abc", "back": "node"})
    assert answer.status_code == 302 and answer["Location"] == "/nodes/n1/"
    page = client.get("/nodes/n1/").content.decode()
    assert "minutes: give the hold&#x27;s length as a whole number of minutes" in page
    assert "whole number of minutes" not in client.get("/nodes/n1/").content.decode()  # once
    answer = client.post(
        "/nodes/n1/maintenance/", {"minutes": "30", "reason": "bios", "back": "node"}
    )
    assert answer.status_code == 302
    assert Node.objects.get(node_id="n1").maintenance_reason == "bios"
    assert "Held for maintenance" in client.get("/nodes/n1/").content.decode()
    client.post("/nodes/n1/end-maintenance/", {"back": "node"})
    assert Node.objects.get(node_id="n1").maintenance_until is None
    assert client.post("/nodes/n1/explode/").status_code == 404
    missing = client.post("/nodes/ghost/drain/", {"back": "nodes"})
    assert missing["Location"] == "/nodes/"
    assert "ghost" in client.get("/nodes/").content.decode()


@pytest.mark.django_db
@pytest.mark.usefixtures("history")  # another test's points of n1 would share its buckets
def test_model_history_json(client: Client, viewer, status_redis) -> None:  # type: ignore[no-untyped-def]
    node = make_node("n1")
    model = make_model("m1", node=node)
    instance = model.placements.get().instance_id
    now = time.time()
    for i in range(3):
        sample = {"engines": [{"instanceId": instance, "rssBytes": 2**30 * (i + 1)}]}
        async_to_sync(telemetry.arecord)(node.node_id, sample, now=now - 10 + 5 * i)
    body = client.get(f"/models/{model.pk}/history.json").json()
    assert [p["memory"] for p in body["points"] if p["memory"] is not None] == [
        2**30,
        2 * 2**30,
        3 * 2**30,
    ]
    assert client.get(f"/models/{model.pk}/history.json", {"window": "x"}).status_code == 400
    assert client.get("/models/9999/history.json").status_code == 404
    other = Client()
    other.force_login(viewer)
    assert other.get(f"/models/{model.pk}/history.json")["Location"].startswith("/login/")


@pytest.mark.django_db
def test_an_operation_the_agent_keeps_open_is_listed_and_needs_attention(
    client: Client, status_redis
) -> None:
    from nodes.monitor_rows import agent_operations

    node = make_node("n1")
    long_ago = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 300))
    just_now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 2))
    heartbeat = {
        "operations": [
            {"id": "op-1", "kind": "launch", "instanceId": "m1-p1", "openedAt": long_ago},
            {"id": "op-2", "kind": "stop", "instanceId": "m1-p2", "openedAt": just_now},
            "junk",
        ]
    }
    _status(node, operations=agent_operations(heartbeat))  # as the monitor stores them
    row = client.get("/nodes/n1/row/").content.decode()
    assert "launch m1-p1 · 5 min ago" in row and re.search(r"stop m1-p2 · [2-4] s ago", row)
    attention = client.get("/overview/summary/").content.decode()
    assert "Agent operation launch of m1-p1 open, opened 5 min ago (op-1)" in attention
    assert "m1-p2" not in attention  # a moment old: normal work
    assert agent_operations({"operations": "nope"}) == []


@pytest.mark.django_db
def test_the_masters_open_operations_are_on_the_node_page_and_need_attention(
    client: Client, status_redis
) -> None:
    import datetime as dt

    from django.utils import timezone

    from nodes.models import MasterOperation

    node = make_node("n1")
    _status(node)
    now = timezone.now()
    for target, seconds, attempts in (("m1-p1", 300, 3), ("m1-p2", 2, 1)):
        MasterOperation.objects.create(
            operation_id=f"m-{target}-0000", node=node, kind="launch", method="POST",
            path="/instances", target=target, attempts=attempts,
            opened_at=now - dt.timedelta(seconds=seconds),
        )  # fmt: skip
    MasterOperation.objects.create(
        operation_id="m-closed-0000", node=node, kind="stop", method="POST", path="/x",
        target="gone-1", state="succeeded", opened_at=now - dt.timedelta(hours=1),
    )  # fmt: skip
    page = client.get("/nodes/n1/current/").content.decode()
    rows = re.findall(r'<tr class="master-op[^"]*">.*?</tr>', page)
    assert len(rows) == 2 and "gone-1" not in page  # the open ones only
    assert "m1-p1" in rows[0] and "5 min ago" in rows[0] and "<td>3</td>" in rows[0]
    assert 'class="master-op error"' in page  # the old one stands out
    attention = client.get("/overview/summary/").content.decode()
    line = "Master operation launch of m1-p1 open, opened 5 min ago, 3 attempt(s) (m-m1-p1-0000)."
    assert line in attention
    assert 'href="/nodes/n1/"' in attention
    assert "m1-p2" not in attention  # a moment old: normal work


def _row_variants(base: dict[str, Any]) -> list[dict[str, Any]]:
    """``base`` (a real node_row) and variants through every branch of the row markup."""
    import datetime

    from console.node_views import certificate

    nasty = "<b>&\"'</b> é"
    cert = dict(base["certificate"])
    rotating = {
        **cert,
        "not_after": "",
        "rotation": {"rotationId": "r1", "stage": "signed", "reason": "manual", "attempts": 1,
                     "lastError": ""},
        "renewalError": f"refused {nasty}",
    }  # fmt: skip
    gpus = [
        {"index": 0, "label": "GPU 0", "name": "H100",
         "bar": {"percent": "50", "text": "40.0 / 80.0 GiB"}, "util": "55"},
        {"index": 1, "label": f"GPU {nasty}", "name": "GPU", "bar": None, "util": None},
    ]  # fmt: skip
    operations = [
        {"kind": "launch", "instance_id": "m1-p1", "id": "op-1", "age": "3 s ago", "stuck": False},
        {"kind": nasty, "instance_id": 7, "id": 12, "age": "", "stuck": True},
    ]
    changes: list[dict[str, Any]] = [
        {},
        {"stale": True, "last_seen": "2026-12-04 10:00:00 UTC", "state": "Offline"},
        {"stale": True, "last_seen": ""},
        {"draining": True, "display_name": nasty, "reasons": f"code-{nasty}"},
        {"labels": "gpu=a100 zone=eu-1", "display_name": "rack 4"},
        {"labels": nasty},
        {
            "maintenance_until": datetime.datetime(2026, 12, 4, 21, 7, tzinfo=datetime.UTC),
            "maintenance_reason": nasty,
        },
        {"last_error": f"connect refused {nasty} " + "x" * 200},
        {"last_error": "short"},
        {"cpu": None, "mem_bar": None, "gpus": [], "os_arch": "", "agent_version": ""},
        {"cpu": "0", "gpus": gpus, "operations": operations, "protocol_text": " · v3"},
        {"certificate": rotating},
        {"certificate": certificate({**cert, "notAfter": None})},  # type: ignore[typeddict-item]
        {"revoked": True},
        {"approved": False, "fingerprint": "SHA256:" + "Q" * 43 + "="},
        {"approved": False, "draining": True, "fingerprint": ""},
        {"node_id": f"n-{nasty}", "url": f"/nodes/{nasty}/", "models_text": "2 / 5"},
    ]
    return [{**base, **change} for change in changes]


@pytest.mark.django_db
@pytest.mark.parametrize("token", ["tok3n" * 12, "", "NOTPROVIDED"])
# Django's {% csrf_token %} warns of its own format_html("") for NOTPROVIDED.
@pytest.mark.filterwarnings("ignore::django.utils.deprecation.RemovedInDjango60Warning")
def test_the_python_rows_are_the_reference_template_byte_for_byte(token: str, status_redis) -> None:
    """console.node_views.row_html writes the lists' rows (issue 19: the row template was
    four fifths of the Nodes page); it must write what that template wrote."""
    from django.template import Context, Template

    from console.node_views import csrf_input, row_html, rows_for

    node = make_node("n1", os="Linux", arch="x86_64", agent_version="0.9.1", protocol_version=2)
    _status(node)
    base = rows_for([Node.objects.get(pk=node.pk)])[0]
    reference = Template((Path(__file__).parent / "node_row_reference.html").read_text())
    for row in _row_variants(base):
        expected = reference.render(Context({"n": row, "csrf_token": token}))
        assert row_html(row, csrf_input(token)) == expected, row


@pytest.mark.django_db
def test_the_nodes_page_renders_its_rows_with_one_token(client: Client, status_redis) -> None:
    for node_id in ("n1", "n2"):
        _status(make_node(node_id))
    page = client.get("/nodes/").content.decode()
    tokens = set(re.findall(r'name="csrfmiddlewaretoken" value="([^"]+)"', page))
    assert page.count('name="csrfmiddlewaretoken"') == 5 and len(tokens) == 1  # and logout
