"""The Nodes and Models pages a page at a time, with search and filters as GET parameters,
and the Overview's first rows with the whole fleet in its tiles."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from core import paging
from models_registry.models import ModelDefinition, Placement
from nodes import listing
from nodes.models import Node
from tests.factories import make_model, make_node, set_status

pytestmark = pytest.mark.django_db

MANY = paging.PAGE_SIZE + 5


@pytest.fixture
def client(operator) -> Client:  # type: ignore[no-untyped-def]
    c = Client()
    c.force_login(operator)
    return c


def _nodes(page: str) -> list[str]:
    return re.findall(r'<tr data-node="([^"]+)"', page)


def _models(page: str) -> list[str]:
    return re.findall(r'<td class="name"><a href="[^"]+">([^<]+)</a>', page)


def _fleet(count: int) -> list[Node]:
    return Node.objects.bulk_create(
        Node(node_id=f"n{i:03d}", address="https://127.0.0.1:1", approved=True)
        for i in range(count)
    )


def test_the_nodes_page_pages_with_links_that_keep_the_filters(
    client: Client, status_redis: object
) -> None:
    _fleet(MANY)
    first = client.get("/nodes/").content.decode()
    assert _nodes(first) == [f"n{i:03d}" for i in range(paging.PAGE_SIZE)]
    assert f"1\u2013{paging.PAGE_SIZE} of {MANY} matching · {MANY} nodes" in first
    assert 'href="?page=2" rel="next"' in first
    second = client.get("/nodes/", {"page": 2}).content.decode()
    assert _nodes(second) == [f"n{i:03d}" for i in range(paging.PAGE_SIZE, MANY)]
    assert 'href="?" rel="prev"' in second and 'data-filtered="1"' in second
    past = client.get("/nodes/", {"page": 40}).content.decode()  # a stale shared link
    assert _nodes(past) == _nodes(second)
    # Filtered: the count is the filter's, links keep it.
    offline = client.get("/nodes/", {"state": "Offline", "q": "n1"}).content.decode()
    assert _nodes(offline) == [f"n{i:03d}" for i in range(100, 200)]
    assert f"100 matching · {MANY} nodes" in offline and 'class="pager"' not in offline


def test_the_nodes_page_filters_on_state_and_model(client: Client, status_redis: object) -> None:
    a, b, c = make_node("gpu-a"), make_node("gpu-b"), make_node("cpu-c")
    set_status(a, "Online")
    set_status(b, "Degraded")
    model = make_model("chat", c)
    Placement.objects.create(model=model, node=a)
    assert _nodes(client.get("/nodes/", {"state": "Degraded"}).content.decode()) == ["gpu-b"]
    assert _nodes(client.get("/nodes/", {"model": "chat"}).content.decode()) == ["cpu-c", "gpu-a"]
    both = client.get("/nodes/", {"model": str(model.pk), "state": "Online"}).content.decode()
    assert _nodes(both) == ["gpu-a"] and 'value="Online" selected' in both
    assert _nodes(client.get("/nodes/", {"model": "nothing"}).content.decode()) == []


@pytest.mark.parametrize(
    ("query", "says"),
    [({"page": "two"}, "page: a whole number"), ({"state": "Asleep"}, "state: one of")],
)
def test_a_bad_value_on_the_nodes_page_says_which(
    client: Client, status_redis: object, query: dict[str, str], says: str
) -> None:
    make_node("n1")
    response = client.get("/nodes/", query)
    assert response.status_code == 400
    assert says in response.content.decode() and 'id="filter-notice"' in response.content.decode()


def test_a_page_past_the_in_list_cap_renders_the_same_rows(
    client: Client, status_redis: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    for node_id in ("c", "a", "b"):
        make_node(node_id)
    expected = _nodes(client.get("/nodes/").content.decode())
    monkeypatch.setattr(listing, "IN_MAX", 1)
    assert _nodes(client.get("/nodes/").content.decode()) == expected == ["a", "b", "c"]


def test_the_models_page_pages_searches_and_filters(client: Client, status_redis: object) -> None:
    node = make_node("n1")
    ModelDefinition.objects.bulk_create(
        ModelDefinition(served_name=f"m{i:03d}", source_folder="f", source_file="m.gguf")
        for i in range(MANY)
    )
    ready = ModelDefinition.objects.get(served_name="m201")
    placement = Placement.objects.create(model=ready, node=node)
    set_status(node, "Online", instances={placement.instance_id: {"state": "Ready"}})
    first = client.get("/models/").content.decode()
    assert _models(first) == [f"m{i:03d}" for i in range(paging.PAGE_SIZE)]
    assert f"1\u2013{paging.PAGE_SIZE} of {MANY} matching · {MANY} models" in first
    second = client.get("/models/", {"page": "2"}).content.decode()
    assert _models(second) == [f"m{i:03d}" for i in range(paging.PAGE_SIZE, MANY)]
    assert _models(client.get("/models/", {"state": "Ready"}).content.decode()) == ["m201"]
    assert _models(client.get("/models/", {"node": "n1"}).content.decode()) == ["m201"]
    found = client.get("/models/", {"q": "M20", "state": "Unplaced"}).content.decode()
    assert _models(found) == [f"m{i:03d}" for i in range(200, MANY) if i != 201]
    empty = client.get("/models/", {"q": "zzz"}).content.decode()
    assert "No model matches." in empty
    refused = client.get("/models/", {"state": "Sleeping"})
    assert refused.status_code == 400 and "state: one of" in refused.content.decode()


def test_the_overview_shows_the_first_rows_and_counts_the_whole_fleet(
    client: Client, status_redis: object
) -> None:
    from console.views import OVERVIEW_ROWS

    nodes = _fleet(OVERVIEW_ROWS + 3)
    for node in nodes[:-1]:
        set_status(node, "Online")
    # The last node, past the table's rows, is Offline: Needs attention still names it.
    last = nodes[-1].node_id
    page = client.get("/").content.decode()
    assert len(_nodes(page)) == OVERVIEW_ROWS and last not in _nodes(page)
    assert f"The first {OVERVIEW_ROWS} of {OVERVIEW_ROWS + 3} nodes" in page
    attention = page[
        page.index('id="attention"') : page.index("</section>", page.index('id="attention"'))
    ]
    assert f'href="/nodes/{last}/"' in attention and nodes[0].node_id not in attention
    assert f"<strong>{OVERVIEW_ROWS + 3}</strong> nodes" in page
    assert f"{OVERVIEW_ROWS + 2} Online</span>" in page and "1 Offline</span>" in page
    summary = client.get("/overview/summary/").content.decode()
    assert last in summary and "<tr data-node" not in summary
