"""GET /api/nodes: filters on state, model and text, pages, and the 400 of a bad value."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from core import paging
from tests.factories import make_model, make_node, set_status

pytestmark = pytest.mark.django_db


def _ids(client: APIClient, **params: Any) -> list[str]:
    response = client.get("/api/nodes", params)
    assert response.status_code == 200, response.content
    return [n["nodeId"] for n in response.json()["nodes"]]


@pytest.fixture
def fleet(status_redis: object) -> None:
    """gpu-a Online holding m-chat, gpu-b Degraded, cpu-c Offline holding m-chat and
    m-embed, new-d waiting for approval."""
    a, b, c = make_node("gpu-a"), make_node("gpu-b", display_name="Rack 7"), make_node("cpu-c")
    make_node("new-d", approved=False, address="https://10.9.9.9:8443")
    set_status(a, "Online")
    set_status(b, "Degraded")
    chat = make_model("m-chat", a)
    chat.placements.create(node=c)
    make_model("m-embed", c)


def test_without_parameters_every_node_and_the_page_fields(
    operator_client: APIClient, fleet: None
) -> None:
    body = operator_client.get("/api/nodes").json()
    assert [n["nodeId"] for n in body["nodes"]] == ["cpu-c", "gpu-a", "gpu-b", "new-d"]
    assert body["count"] == 4 and body["offset"] == 0 and body["next"] is None
    assert body["limit"] == paging.UNPAGED_MAX
    assert body["stale"] is False and "statusAsOf" in body


def test_state_filter_repeated_and_comma_listed(operator_client: APIClient, fleet: None) -> None:
    assert _ids(operator_client, state="Online") == ["gpu-a"]
    assert _ids(operator_client, state="online,degraded") == ["gpu-a", "gpu-b"]
    response = operator_client.get("/api/nodes?state=Offline&state=PendingApproval")
    assert [n["nodeId"] for n in response.json()["nodes"]] == ["cpu-c", "new-d"]
    assert response.json()["count"] == 2


def test_model_filter_by_served_name_or_id(operator_client: APIClient, fleet: None) -> None:
    assert _ids(operator_client, model="m-chat") == ["cpu-c", "gpu-a"]
    embed = operator_client.get("/api/models", {"search": "embed"}).json()["models"][0]
    assert _ids(operator_client, model=str(embed["id"])) == ["cpu-c"]
    assert _ids(operator_client, model="no-such-model") == []
    assert _ids(operator_client, model="m-chat", state="Online") == ["gpu-a"]


def test_search_matches_id_name_address_and_reason(operator_client: APIClient, fleet: None) -> None:
    assert _ids(operator_client, search="GPU") == ["gpu-a", "gpu-b"]
    assert _ids(operator_client, search="rack 7") == ["gpu-b"]
    assert _ids(operator_client, search="10.9.9.9") == ["new-d"]
    assert _ids(operator_client, search="zzz") == []


def test_pages_with_limit_and_offset(operator_client: APIClient, fleet: None) -> None:
    first = operator_client.get("/api/nodes", {"limit": 3}).json()
    assert [n["nodeId"] for n in first["nodes"]] == ["cpu-c", "gpu-a", "gpu-b"]
    assert first["count"] == 4 and first["limit"] == 3 and first["next"] == 3
    rest = operator_client.get("/api/nodes", {"limit": 3, "offset": first["next"]}).json()
    assert [n["nodeId"] for n in rest["nodes"]] == ["new-d"] and rest["next"] is None
    past = operator_client.get("/api/nodes", {"offset": 10}).json()
    assert past["nodes"] == [] and past["count"] == 4
    # A page of a filtered list: count is the filter's.
    gpus = operator_client.get("/api/nodes", {"search": "gpu", "limit": 1}).json()
    assert gpus["count"] == 2 and gpus["next"] == 1


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ("state=Sleeping", "state", "one of PendingApproval, Online"),
        ("state=Online,,Nope", "state", "not 'Nope'"),
        ("limit=0", "limit", "from 1 to 1000"),
        ("limit=1001", "limit", "from 1 to 1000"),
        ("limit=ten", "limit", "a whole number"),
        ("limit=-5", "limit", "a whole number"),
        ("offset=-1", "offset", "a whole number"),
        ("search=" + "x" * 101, "search", "at most 100 characters"),
        ("model=" + "m" * 201, "model", "at most 200 characters"),
        ("state=" + ",".join(["Online"] * 51), "state", "at most 50 values"),
    ],
)
def test_a_bad_value_is_a_400_naming_the_parameter(
    operator_client: APIClient, fleet: None, query: str, field: str, says: str
) -> None:
    response = operator_client.get("/api/nodes?" + query)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["message"].startswith(f"{field}: ")
    assert says in error["message"] and error["details"] == {"field": field}


def test_the_list_reads_statuses_in_one_round_trip(
    operator_client: APIClient, fleet: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nodes import status_cache

    calls: list[int] = []
    read_many = status_cache.read_many

    def counted(node_ids: list[str]) -> Any:
        calls.append(len(node_ids))
        return read_many(node_ids)

    monkeypatch.setattr(status_cache, "read_many", counted)
    monkeypatch.setattr(status_cache, "read", lambda *a: pytest.fail("one read per node"))
    assert _ids(operator_client, state="Online,Degraded", limit=1) == ["gpu-a"]
    assert calls == [4]  # every candidate once, for the filter; the page reuses them


def test_without_permission(anon_client: APIClient, viewer_client: APIClient) -> None:
    for url in ("/api/nodes?state=Online", "/api/nodes?limit=1", "/api/models?state=Ready"):
        assert anon_client.get(url).status_code in (401, 403)
        assert viewer_client.get(url).status_code == 403
