"""Routes (aliases with fallbacks): the service's rules and /api/routes."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from core.errors import ServiceError
from models_registry import routes, services
from models_registry.models import ModelDefinition, Route
from nodes.models import AuditEvent
from tests.factories import make_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def models() -> None:
    for name in ("a", "b", "c"):
        make_model(name)


def _refusal(data: dict[str, Any], instance: Route | None = None) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        if instance is None:
            routes.create_route(data)
        else:
            routes.update_route(instance, data)
    return caught.value


@pytest.mark.usefixtures("models")
def test_a_route_is_created_changed_and_deleted_with_its_audit() -> None:
    row = routes.create_route({"name": "chat-default", "targets": ["b", "a"]})
    assert (row.name, row.targets) == ("chat-default", ["b", "a"])
    assert routes.get_route("chat-default") == row == routes.get_route(str(row.pk))
    routes.update_route(row, {"targets": ["a"]})
    routes.update_route(row, {"targets": ["a"]})  # nothing changes: nothing recorded
    routes.update_route(row, {"name": "org/chat"})
    assert routes.get_route("org/chat").targets == ["a"]
    routes.delete_route(row)
    assert not Route.objects.exists()
    events = list(AuditEvent.objects.filter(action__startswith="route.").order_by("pk"))
    assert [e.action for e in events] == [
        "route.created", "route.changed", "route.changed", "route.deleted",
    ]  # fmt: skip
    assert events[1].detail["before"]["targets"] == ["b", "a"]
    assert events[1].detail["after"]["targets"] == ["a"]
    assert events[2].subject == "org/chat"


@pytest.mark.usefixtures("models")
@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"targets": ["a"]}, "name", "letters, digits"),
        ({"name": "has space", "targets": ["a"]}, "name", "letters, digits"),
        ({"name": "", "targets": ["a"]}, "name", "letters, digits"),
        ({"name": 7, "targets": ["a"]}, "name", "letters, digits"),
        ({"name": "r"}, "targets", "list of served names"),
        ({"name": "r", "targets": "a"}, "targets", "list of served names"),
        ({"name": "r", "targets": [1]}, "targets", "list of served names"),
        ({"name": "r", "targets": []}, "targets", "1 to 16"),
        ({"name": "r", "targets": [f"x{i}" for i in range(17)]}, "targets", "1 to 16"),
        ({"name": "r", "targets": ["a", "b", "a"]}, "targets", "'a' is listed twice"),
        ({"name": "r", "targets": ["a", "nope"]}, "targets", "'nope'"),
        ({"name": "r", "targets": ["a"], "fallback": True}, "fallback", "unknown field"),
    ],
)
def test_bad_input_is_refused_naming_the_field(data: dict, field: str, words: str) -> None:
    error = _refusal(data)
    assert error.status == 400 and error.code == "invalid_request"
    assert error.message.startswith(f"{field}: ") and words in error.message
    assert not Route.objects.exists()


@pytest.mark.usefixtures("models")
def test_a_route_and_a_model_never_share_a_name() -> None:
    error = _refusal({"name": "a", "targets": ["b"]})
    assert (error.status, error.code) == (409, "route_name_taken")
    assert error.message.startswith("name: ") and "served name" in error.message
    row = routes.create_route({"name": "r", "targets": ["a"]})
    assert _refusal({"name": "r", "targets": ["b"]}).status == 409
    other = routes.create_route({"name": "s", "targets": ["b"]})
    assert _refusal({"name": "r"}, instance=other).code == "route_name_taken"
    # The other way round: no model may be created or renamed to a route's name.
    with pytest.raises(ServiceError) as caught:
        services.create_model(
            {"served_name": "r", "source_folder": "f", "source_file": "m.gguf", "settings": {}}
        )
    assert caught.value.status == 409 and caught.value.message.startswith("served_name: ")
    assert "route" in caught.value.message
    with pytest.raises(ServiceError) as caught:
        services.update_model(ModelDefinition.objects.get(served_name="c"), {"served_name": "s"})
    assert caught.value.status == 409
    assert row.name == "r"


@pytest.mark.usefixtures("models")
def test_a_routed_model_is_neither_deleted_nor_renamed() -> None:
    routes.create_route({"name": "r", "targets": ["a", "b"]})
    model = ModelDefinition.objects.get(served_name="a")
    with pytest.raises(ServiceError) as caught:
        services.delete_model(model)
    assert (caught.value.status, caught.value.code) == (409, "model_in_route")
    assert "'r'" in caught.value.message
    with pytest.raises(ServiceError) as caught:
        services.update_model(model, {"served_name": "a2"})
    assert caught.value.code == "model_in_route"
    services.update_model(model, {"auto_start": True})  # a change that keeps the name
    services.delete_model(ModelDefinition.objects.get(served_name="c"))  # not routed


def test_unknown_route_is_404() -> None:
    with pytest.raises(ServiceError) as caught:
        routes.get_route("missing")
    assert caught.value.status == 404


# --- /api/routes ---------------------------------------------------------------------


@pytest.mark.usefixtures("models")
def test_api_create_list_change_delete(operator_client: APIClient) -> None:
    created = operator_client.post(
        "/api/routes", {"name": "org/chat", "targets": ["a", "b"]}, format="json"
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["name"] == "org/chat" and body["targets"] == ["a", "b"]
    assert {"id", "createdAt", "updatedAt"} <= set(body)
    listed = operator_client.get("/api/routes").json()["routes"]
    assert [r["name"] for r in listed] == ["org/chat"]
    by_name = operator_client.get("/api/routes/org/chat")
    assert by_name.status_code == 200 and by_name.json()["id"] == body["id"]
    changed = operator_client.patch(
        f"/api/routes/{body['id']}", {"targets": ["b", "a"]}, format="json"
    )
    assert changed.status_code == 200 and changed.json()["targets"] == ["b", "a"]
    assert operator_client.delete("/api/routes/org/chat").status_code == 204
    assert operator_client.get("/api/routes/org/chat").status_code == 404


@pytest.mark.usefixtures("models")
def test_api_refusals_name_the_field(operator_client: APIClient) -> None:
    bad = operator_client.post("/api/routes", {"name": "r", "targets": ["zz"]}, format="json")
    assert bad.status_code == 400
    assert bad.json()["error"]["message"].startswith("targets: ")
    assert bad.json()["error"]["details"] == {"field": "targets"}
    taken = operator_client.post("/api/routes", {"name": "a", "targets": ["b"]}, format="json")
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "route_name_taken"
    not_object = operator_client.post("/api/routes", ["a"], format="json")
    assert not_object.status_code == 400
    unknown = operator_client.post(
        "/api/routes", {"name": "r", "targets": ["a"], "x": 1}, format="json"
    )
    assert unknown.status_code == 400 and "x" in unknown.json()["error"]["message"]
    assert operator_client.patch("/api/routes/nope", {}, format="json").status_code == 404
    model = ModelDefinition.objects.get(served_name="a")
    operator_client.post("/api/routes", {"name": "r", "targets": ["a"]}, format="json")
    refused = operator_client.delete(f"/api/models/{model.pk}")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_in_route"


@pytest.mark.usefixtures("models")
def test_api_without_permission(viewer_client: APIClient, chat_key: str) -> None:
    routes.create_route({"name": "r", "targets": ["a"]})
    key_client = APIClient()
    key_client.credentials(HTTP_AUTHORIZATION=f"Bearer {chat_key}")
    for client in (viewer_client, key_client):
        assert client.get("/api/routes").status_code == 403
        assert client.post("/api/routes", {"name": "s", "targets": ["a"]}).status_code == 403
        assert client.patch("/api/routes/r", {"targets": ["b"]}).status_code == 403
        assert client.delete("/api/routes/r").status_code == 403
    assert routes.get_route("r").targets == ["a"]
    assert APIClient().get("/api/routes").status_code == 401


@pytest.mark.usefixtures("models")
def test_every_change_is_announced_to_the_routers_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from router import signals

    sent: list[tuple[str, str | None]] = []
    monkeypatch.setattr(signals, "announce", lambda kind, name=None: sent.append((kind, name)))
    row = routes.create_route({"name": "r", "targets": ["a"]})
    routes.update_route(row, {"targets": ["b"]})
    routes.update_route(row, {"name": "s"})  # the old name is dropped too
    routes.delete_route(row)
    assert sent == [("routes", "r"), ("routes", "r"), ("routes", "r"), ("routes", "s"),
                    ("routes", "s")]  # fmt: skip
