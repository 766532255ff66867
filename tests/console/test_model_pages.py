"""The console's Models list, a model's row and page, and their actions (issue 14):
operators only, the cells model.updated sets equal the rendered ones, post/redirect/get."""

from __future__ import annotations

import asyncio
from html.parser import HTMLParser

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from models_registry import services
from models_registry.models import ModelDefinition, Placement
from nodes import status_cache
from nodes.models import Node
from nodes.monitor import NodeWorker
from protocol.tinygguf import write_tiny_gguf
from tests.factories import make_model, make_node, set_status
from tests.nodes.conftest import Enrolled

GIB = 2**30
DASH = "\u2013"  # what the pages print for an unknown value


class Cells(HTMLParser):
    """The text of each classed ``<td>`` of one ``<tr data-model=...>``."""

    def __init__(self, model_id: int) -> None:
        super().__init__()
        self.want = str(model_id)
        self.inside = False
        self.cell: str | None = None
        self.depth = 0
        self.cells: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr":
            self.inside = found.get("data-model") == self.want
        elif tag == "td" and self.inside:
            self.cell = (found.get("class") or "").split()[0]
            self.cells[self.cell] = ""
        elif self.cell is not None:
            self.cells[self.cell] += " "  # an element inside a cell separates its text

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self.cell = None
        elif tag == "tr":
            self.inside = False

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cells[self.cell] += data


def cells(html: str, model_id: int) -> dict[str, str]:
    parser = Cells(model_id)
    parser.feed(html)
    return {k: " ".join(v.split()) for k, v in parser.cells.items()}


def as_operator(user: object) -> Client:
    client = Client()
    client.force_login(user)  # type: ignore[arg-type]
    return client


@pytest.mark.django_db
def test_every_model_page_and_action_needs_an_operator(viewer, status_redis) -> None:
    model = make_model("m1", make_node("n1"))
    pages = ["/models/", "/models/new/", f"/models/{model.pk}/", f"/models/{model.pk}/row/",
             f"/models/{model.pk}/edit/"]  # fmt: skip
    posts = [f"/models/{model.pk}/{a}/" for a in ("start", "stop", "restart", "delete")]
    posts += ["/models/estimate/", "/models/new/", f"/models/{model.pk}/edit/"]
    for client in (Client(), as_operator(viewer)):  # anonymous, then not staff
        for url in pages:
            answer = client.get(url)
            assert answer.status_code == 302 and answer["Location"].startswith("/login/"), url
        for url in posts:
            answer = client.post(url, {"served_name": "taken-over"})
            assert answer.status_code == 302 and answer["Location"].startswith("/login/"), url
    # Nothing happened: the model is there, unchanged, and no other was created.
    assert list(ModelDefinition.objects.values_list("served_name", "desired_state")) == [
        ("m1", "stopped")
    ]


@pytest.mark.django_db
def test_the_list_renders_the_cells_the_live_event_sets(operator, status_redis) -> None:
    node = make_node("n1")
    model = make_model("qwen", node)
    other = make_model("idle")  # unplaced
    placement = model.placements.get()
    set_status(
        node,
        "Online",
        {
            placement.instance_id: {
                "instanceId": placement.instance_id,
                "modelId": model.pk,
                "state": "Failed",
                "error": "exit 1: out of memory",
                "restartCount": 2,
                "measured": {"bytes": 3 * GIB + GIB // 4, "kind": "rss"},
            }
        },
    )
    model.memory_budget_bytes = 3 * GIB
    model.save()
    client = as_operator(operator)
    html = client.get("/models/").content.decode()
    summary = services.model_summary(model, {"n1": status_cache.read("n1")})  # type: ignore[dict-item]
    row = cells(html, model.pk)
    # What models.js sets from the event, formatted as it formats it.
    assert row["name"] == summary["servedName"] == "qwen"
    assert (
        row["state"] == f"{summary['state']} {summary['error']}" == "Failed exit 1: out of memory"
    )
    assert row["node"] == summary["nodeId"] == "n1"
    assert summary["measuredBytes"] is not None
    assert row["measured"] == f"{summary['measuredBytes'] / GIB:.2f} GiB" == "3.25 GiB"
    assert row["restarts"] == str(summary["restartCount"]) == "2"
    # What only the render has: nodes, budget, the over-budget note, flags, queue.
    assert row["nodes"] == "n1"
    assert row["budget"] == "3.00 GiB (set by hand)"
    assert "n1: uses 0.2 GiB more than its budget" in row["pending"]
    assert row["flags"] == DASH and row["queue"] == DASH
    idle = cells(html, other.pk)
    assert idle["state"] == "Unplaced" and idle["node"] == "-" and idle["measured"] == DASH
    for action in ("start", "stop", "restart", "delete"):
        assert f'data-action="{action}"' in html
    assert 'data-confirm="Delete the model' in html
    # The row models.js fetches after an event is the list's row, cell for cell.
    fragment = client.get(f"/models/{model.pk}/row/").content.decode()
    assert cells(fragment, model.pk) == row
    assert client.get("/models/99999/row/").status_code == 404


@pytest.mark.django_db
def test_the_model_page_shows_state_cause_replicas_kpis_and_actions(operator, status_redis) -> None:
    node = make_node("n1")
    model = make_model("qwen", node)
    placement = model.placements.get()
    set_status(node, "Online", {placement.instance_id: {"state": "Failed", "error": "exit 3"}})
    client = as_operator(operator)
    html = client.get(f"/models/{model.pk}/").content.decode()
    assert 'id="model-state" class="state"><span class="badge s-Failed">Failed</span>' in html
    assert 'id="model-error" class="error">exit 3<' in html
    assert f'data-instance="{placement.instance_id}"' in html
    assert f'id="charts" data-src="/models/{model.pk}/history.json" data-kind="model"' in html
    # The first replica's engine log, in the shared log panel.
    assert f'id="logs-panel" data-node="n1" data-log="{placement.instance_id}"' in html
    # No telemetry stored: every KPI is unknown, not zero.
    for kpi in ("running", "waiting", "prompt-tps", "gen-tps", "prefix-hit"):
        assert f'id="kpi-{kpi}">{DASH}<' in html
    assert 'data-action="start-force"' in html and f"/models/{model.pk}/edit/" in html
    assert client.get("/models/99999/").status_code == 404


@pytest.mark.django_db
def test_actions_redirect_and_say_what_happened_once(operator, status_redis) -> None:
    unplaced = make_model("lonely")
    running = make_model("busy")
    ModelDefinition.objects.filter(pk=running.pk).update(desired_state="running")
    client = as_operator(operator)

    answer = client.post(f"/models/{unplaced.pk}/start/")
    assert answer.status_code == 302 and answer["Location"] == "/models/"
    first = client.get("/models/").content.decode()
    assert "Model &#x27;lonely&#x27; has no placement; place it first." in first
    assert "has no placement" not in client.get("/models/").content.decode()  # shown once

    # From the model page, back to it.
    answer = client.post(f"/models/{unplaced.pk}/restart/", {"back": "model"})
    assert answer["Location"] == f"/models/{unplaced.pk}/"
    assert "has no placement" in client.get(answer["Location"]).content.decode()

    answer = client.post(f"/models/{running.pk}/delete/", {"back": "model"})
    assert answer["Location"] == "/models/"  # a deleted model has no page to go back to
    assert "Stop the model before deleting it." in client.get("/models/").content.decode()
    assert ModelDefinition.objects.filter(pk=running.pk).exists()

    answer = client.post(f"/models/{unplaced.pk}/delete/")
    assert answer.status_code == 302
    assert "Deleted model &#x27;lonely&#x27;." in client.get("/models/").content.decode()
    assert not ModelDefinition.objects.filter(pk=unplaced.pk).exists()

    assert client.post(f"/models/{running.pk}/explode/").status_code == 404
    assert client.get(f"/models/{running.pk}/start/").status_code == 405  # POST only
    answer = client.post("/models/4242/stop/")
    assert "Model 4242 does not exist." in client.get(answer["Location"]).content.decode()


async def _connect(enrolled: Enrolled) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
    finally:
        await worker.client.aclose()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_start_and_stop_go_through_the_lifecycle_to_a_real_agent(
    enrolled: Enrolled, operator
) -> None:
    await _connect(enrolled)
    write_tiny_gguf(enrolled.server.config.models_root_path / "tiny" / "tiny.gguf")

    def define() -> ModelDefinition:
        model = ModelDefinition.objects.create(
            served_name="tiny", source_folder="tiny", source_file="tiny.gguf",
            settings={"context_size": 256},
        )  # fmt: skip
        Placement.objects.create(model=model, node=Node.objects.get(node_id="n1"))
        return model

    model = await sync_to_async(define)()
    client = await sync_to_async(as_operator)(operator)
    post, get = sync_to_async(client.post), sync_to_async(client.get)

    # The agent was asked: this one has no llama-server, and its refusal is the message.
    answer = await post(f"/models/{model.pk}/start/", {"back": "model"})
    assert answer.status_code == 302 and answer["Location"] == f"/models/{model.pk}/"
    page = (await get(answer["Location"])).content.decode()
    assert 'class="messages"' in page and "Node n1: " in page
    saved = await sync_to_async(ModelDefinition.objects.get)(pk=model.pk)
    assert saved.estimate["architecture"] == "llama"  # the header was read before admission

    await sync_to_async(ModelDefinition.objects.filter(pk=model.pk).update)(desired_state="running")
    answer = await post(f"/models/{model.pk}/stop/")
    assert answer.status_code == 302
    page = (await get("/models/")).content.decode()
    assert "Stopped &#x27;tiny&#x27;." in page
    saved = await sync_to_async(ModelDefinition.objects.get)(pk=model.pk)
    assert saved.desired_state == "stopped"


def test_the_action_urls_a_row_builds_are_the_routes() -> None:
    """model_actions.html appends the action to the model's URL instead of reversing each
    one: that holds only while the routes stay below the model's page."""
    from django.urls import reverse

    base = reverse("model", args=[7])
    for action in ("start", "stop", "restart", "delete"):
        assert reverse("model-action", args=[7, action]) == f"{base}{action}/"
    assert reverse("model-edit", args=[7]) == f"{base}edit/"


def test_a_row_shows_the_routers_queue_and_metrics_carry_it(operator, status_redis) -> None:
    from router import queue as fair_queue
    from router.fleet_metrics import families

    model = make_model("queued-model", make_node("n1"))
    base = fair_queue.base(model.served_name)
    status_redis.hset(base + "waiters", mapping={"p1:1": "0\t1", "p1:2": "0\t2"})
    status_redis.set(base + "wait", "1500.0")
    try:
        html = as_operator(operator).get("/models/").content.decode()
        assert "2 queued in the router · last wait 1500 ms" in html
        found = {
            (family.name, sample.labels.get("model")): sample.value
            for family in families()
            for sample in family.samples
        }
        assert found[("mirbad_router_queue_depth", "queued-model")] == 2.0
        assert found[("mirbad_router_queue_last_wait_seconds", "queued-model")] == 1.5
    finally:
        status_redis.delete(base + "waiters", base + "wait")
