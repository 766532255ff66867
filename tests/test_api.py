"""/api: personas and permissions for every endpoint, then the behaviour."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from models_registry.models import ModelDefinition
from router.models import ApiKey
from tests.factories import make_model, make_node, set_status

pytestmark = pytest.mark.django_db

ENDPOINTS = [
    ("get", "/api/nodes"),
    ("get", "/api/nodes/n1"),
    ("patch", "/api/nodes/n1"),
    ("post", "/api/nodes/n1/approve"),
    ("post", "/api/nodes/n1/revoke"),
    ("post", "/api/nodes/n1/drain"),
    ("post", "/api/nodes/n1/undrain"),
    ("post", "/api/nodes/n1/rekey"),
    ("post", "/api/nodes/n1/rotate"),
    ("get", "/api/nodes/n1/operations"),
    ("get", "/api/nodes/n1/images"),
    ("post", "/api/nodes/n1/maintenance"),
    ("delete", "/api/nodes/n1/maintenance"),
    ("post", "/api/join-tokens"),
    ("post", "/api/takeover"),
    ("get", "/api/models"),
    ("post", "/api/models"),
    ("get", "/api/models/1"),
    ("patch", "/api/models/1"),
    ("delete", "/api/models/1"),
    ("post", "/api/models/1/start"),
    ("post", "/api/models/1/stop"),
    ("post", "/api/models/1/restart"),
    ("get", "/api/models/1/estimate"),
    ("get", "/api/models/1/placement-suggestions"),
    ("get", "/api/estimate-accuracy"),
    ("get", "/api/model-folders"),
    ("get", "/api/model-folders/f"),
    ("get", "/api/model-folders/f/gguf"),
    ("get", "/api/downloads"),
    ("post", "/api/downloads"),
    ("get", "/api/downloads/inspect"),
    ("get", "/api/downloads/f"),
    ("delete", "/api/downloads/f"),
    ("get", "/api/reclaim"),
    ("post", "/api/reclaim"),
    ("get", "/api/routes"),
    ("post", "/api/routes"),
    ("get", "/api/routes/r"),
    ("patch", "/api/routes/r"),
    ("delete", "/api/routes/r"),
    ("get", "/api/keys"),
    ("post", "/api/keys"),
    ("patch", "/api/keys/1"),
    ("delete", "/api/keys/1"),
    ("get", "/api/audit"),
    ("get", "/api/audit.csv"),
    ("get", "/api/usage"),
    ("get", "/api/usage.csv"),
    ("get", "/api/backups"),
    ("post", "/api/backups"),
    ("get", "/api/backups/download/t"),
    ("get", "/api/schema"),
    ("get", "/api/docs"),
]


def test_every_api_route_is_in_the_permission_tests() -> None:
    """A new /api route cannot be added without its 401/403 tests."""
    from mirbad_site.urls import urlpatterns

    covered = {path for _, path in ENDPOINTS}
    samples = {"<str:node_id>": "n1", "<int:model_id>": "1", "<int:key_id>": "1",
               "<str:folder>": "f", "<str:token>": "t", "<path:route>": "r"}  # fmt: skip
    for pattern in urlpatterns:
        route = str(pattern.pattern)
        if not route.startswith("api/"):
            continue
        for placeholder, value in samples.items():
            route = route.replace(placeholder, value)
        assert "/" + route in covered, f"/{route} has no permission test in ENDPOINTS"


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_without_login_is_401(anon_client: APIClient, method: str, path: str) -> None:
    response = getattr(anon_client, method)(path, {}, format="json")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_without_permission_is_403(viewer_client: APIClient, method: str, path: str) -> None:
    response = getattr(viewer_client, method)(path, {}, format="json")
    assert response.status_code == 403
    assert "admin" in response.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_key_without_admin_scope_is_403(chat_key: str, method: str, path: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {chat_key}")
    response = getattr(client, method)(path, {}, format="json")
    assert response.status_code == 403


def test_unknown_key_is_401() -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer mbd-nope")
    response = client.get("/api/nodes")
    assert response.status_code == 401
    assert "unknown" in response.json()["error"]["message"]


def test_admin_key_lists_nodes_with_live_state(admin_key: str, status_redis: object) -> None:
    node = make_node("n1")
    set_status(node, "Online")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    body = client.get("/api/nodes").json()
    assert body["nodes"][0]["nodeId"] == "n1"
    assert body["nodes"][0]["state"] == "Online"
    assert client.get("/api/nodes/zzz").status_code == 404


def test_create_model_and_validation(operator_client: APIClient, status_redis: object) -> None:
    make_node("n1")
    ok = operator_client.post(
        "/api/models",
        {
            "servedName": "demo",
            "sourceFolder": "demo",
            "sourceFile": "demo.gguf",
            "settings": {"context_size": 512},
            "node": "n1",
        },
        format="json",
    )
    assert ok.status_code == 201, ok.json()
    assert ok.json()["placements"][0]["node"] == "n1"
    assert ok.json()["state"] == "Offline"  # no status yet
    dup = operator_client.post(
        "/api/models",
        {"servedName": "demo", "sourceFolder": "d", "sourceFile": "x.gguf"},
        format="json",
    )
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "served_name_taken"
    bad = operator_client.post(
        "/api/models",
        {"servedName": "x", "sourceFolder": "../etc", "sourceFile": "x.gguf"},
        format="json",
    )
    assert bad.status_code == 400 and "sourceFolder" not in bad.json()["error"]["message"]
    assert bad.json()["error"]["message"].startswith("source_folder:")
    settings = operator_client.post(
        "/api/models",
        {
            "servedName": "y",
            "sourceFolder": "y",
            "sourceFile": "y.gguf",
            "settings": {"parallel": 0},
        },
        format="json",
    )
    assert settings.status_code == 400
    assert settings.json()["error"]["code"] == "llamacpp_settings_invalid"
    assert "settings.parallel" in settings.json()["error"]["message"]
    unknown = operator_client.post("/api/models", {"colour": "red"}, format="json")
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"]


def test_start_refusals(operator_client: APIClient, status_redis: object) -> None:
    assert operator_client.post("/api/models/999/start").status_code == 404
    unplaced = make_model("lonely")
    response = operator_client.post(f"/api/models/{unplaced.pk}/start")
    assert response.status_code == 409 and response.json()["error"]["code"] == "model_unplaced"
    node = make_node("n1")
    model = make_model("m", node)
    response = operator_client.post(f"/api/models/{model.pk}/start")
    assert response.status_code == 503
    assert "not serving (state: Offline)" in response.json()["error"]["message"]
    node.draining = True
    node.save()
    response = operator_client.post(f"/api/models/{model.pk}/start")
    assert response.status_code == 409 and response.json()["error"]["code"] == "node_draining"


def test_start_before_the_monitor_ever_ran_is_503(
    operator_client: APIClient, status_redis: object
) -> None:
    # No identity row: this test's database has none (nodes/fencing.py, D81).
    node = make_node("n1", address="https://127.0.0.1:9")
    set_status(node, "Online")
    model = make_model("m", node)
    response = operator_client.post(f"/api/models/{model.pk}/start")
    assert response.status_code == 503
    assert "monitor has not started" in response.json()["error"]["message"]


def test_start_with_unreachable_agent_is_503(
    operator_client: APIClient, status_redis: object, master_identity: object
) -> None:
    node = make_node("n1", address="https://127.0.0.1:9")  # nothing listens on port 9
    set_status(node, "Online")
    model = make_model("m", node)
    response = operator_client.post(f"/api/models/{model.pk}/start")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "node_unreachable"
    assert ModelDefinition.objects.get(pk=model.pk).desired_state == "stopped"


def test_delete_running_model_refused(operator_client: APIClient) -> None:
    model = make_model("m")
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="running")
    assert operator_client.delete(f"/api/models/{model.pk}").status_code == 409
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="stopped")
    assert operator_client.delete(f"/api/models/{model.pk}").status_code == 204


def test_keys_shown_once_and_stored_hashed(operator_client: APIClient) -> None:
    created = operator_client.post(
        "/api/keys", {"name": "app", "scopes": ["chat"]}, format="json"
    ).json()
    assert created["key"].startswith("mbd-")
    row = ApiKey.objects.get(pk=created["id"])
    assert created["key"] not in (row.key_hash, row.prefix)
    listed = operator_client.get("/api/keys").json()["keys"]
    assert "key" not in listed[0]
    bad = operator_client.post("/api/keys", {"name": "x", "scopes": ["root"]}, format="json")
    assert bad.status_code == 400 and "unknown scope" in bad.json()["error"]["message"]
    assert operator_client.delete(f"/api/keys/{created['id']}").status_code == 204
    assert ApiKey.objects.get(pk=created["id"]).revoked_at is not None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sourceFolder", "tiny\n"),
        ("servedName", "tiny\n"),
        ("sourceFile", "tiny.gguf\n"),
        ("sourceFolder", "ti\x00ny"),
    ],
)
def test_a_trailing_newline_or_nul_in_a_name_is_refused(operator_client, field, value) -> None:
    """``re.match`` with ``$`` takes "tiny\\n"; the agent refuses it later, so must the API."""
    body = {"servedName": "tiny", "sourceFolder": "tiny", "sourceFile": "tiny.gguf"}
    body[field] = value
    answer = operator_client.post("/api/models", body, format="json")
    assert answer.status_code == 400, answer.json()
    assert answer.json()["error"]["details"]["field"] in (
        "source_folder",
        "served_name",
        "source_file",
        "sourceFolder",  # a NUL: refused by the JSON parser, named as the body names it
    )
