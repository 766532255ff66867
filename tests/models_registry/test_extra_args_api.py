"""/api/models with an admin key: extra_args and chat_template off the allow-list (issue 11)."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from core.errors import ServiceError
from models_registry import lifecycle
from models_registry.models import ModelDefinition, Placement
from tests.engine_flag_attacks import BYPASSES, ISSUE_ATTACKS, MCP_JSON
from tests.factories import make_model, make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_api(admin_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    return client


def create(client: APIClient, settings: dict[str, Any]) -> Any:
    return client.post(
        "/api/models",
        {
            "servedName": "demo",
            "sourceFolder": "demo",
            "sourceFile": "demo.gguf",
            "settings": settings,
        },
        format="json",
    )


def assert_refused(response: Any, field: str, needle: str) -> None:
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "llamacpp_settings_invalid"
    assert error["message"].startswith(f"settings.{field}: ")
    assert needle in error["message"]
    assert list(error["details"]["fields"]) == [f"settings.{field}"]


@pytest.mark.parametrize(("extra", "flag"), ISSUE_ATTACKS + BYPASSES)
def test_create_with_a_flag_off_the_allow_list_is_400(
    admin_api: APIClient, extra: list[str], flag: str
) -> None:
    assert_refused(create(admin_api, {"extra_args": extra}), "extra_args", repr(flag))
    assert not ModelDefinition.objects.exists()


def test_chat_template_path_is_400(admin_api: APIClient) -> None:
    response = create(admin_api, {"chat_template": "builtin:../../etc"})
    assert_refused(response, "chat_template", "'../../etc' is not a llama.cpp 0.6 built-in")


def test_patch_cannot_add_a_refused_flag(admin_api: APIClient) -> None:
    created = create(admin_api, {"extra_args": ["--temp", "0.3"]})
    assert created.status_code == 201, created.json()
    model_id = created.json()["id"]
    patched = admin_api.patch(
        f"/api/models/{model_id}",
        {"settings": {"extra_args": ["--mcp-servers-json", MCP_JSON]}},
        format="json",
    )
    assert_refused(patched, "extra_args", "'--mcp-servers-json'")
    assert ModelDefinition.objects.get(pk=model_id).settings["extra_args"] == ["--temp", "0.3"]


def test_allowed_extra_args_and_template_are_saved(admin_api: APIClient) -> None:
    extra = ["--temp", "0.7", "--top-k", "40", "--reasoning-format", "deepseek"]
    response = create(admin_api, {"extra_args": extra, "chat_template": "builtin:chatml"})
    assert response.status_code == 201, response.json()
    assert response.json()["settings"]["extra_args"] == extra


def test_a_model_saved_before_the_allow_list_is_refused_at_start_not_500() -> None:
    """Settings saved under the old refusal list: a clear 409 naming the field."""
    model = make_model("old", node=make_node("n1"))
    model.settings = {"extra_args": ["--mcp-servers-json", MCP_JSON]}
    model.save()
    placement = Placement.objects.get(model=model)
    with pytest.raises(ServiceError) as info:
        lifecycle.launch_spec(model, placement)
    assert info.value.status == 409 and info.value.code == "llamacpp_settings_invalid"
    assert "settings.extra_args" in info.value.message
    assert "'--mcp-servers-json'" in info.value.message
    running = {"state": "Ready", "fingerprint": "sha256:x", "executable": {"version": "0.6.0"}}
    assert lifecycle.restart_pending(model, placement, running) is True
