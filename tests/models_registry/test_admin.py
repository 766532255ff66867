"""The Django admin for models: saved through services, started through the lifecycle (D60)."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.test import Client

from models_registry.models import ModelDefinition, Placement
from nodes.models import Node
from tests.factories import make_model, make_node, set_status
from tests.models_registry.test_lifecycle import connect, define
from tests.nodes.conftest import Enrolled
from tests.nodes.test_admin import _act, _cell

LIST = "/admin/models_registry/modeldefinition/"


@pytest.fixture
def admin_client(db: None) -> Client:
    """A staff superuser logged in to the Django admin."""
    user = get_user_model().objects.create_user(
        "root", password="pw-root-1", is_staff=True, is_superuser=True
    )
    client = Client()
    client.force_login(user)
    return client


def _form(model: ModelDefinition, **changes: Any) -> dict[str, Any]:
    """The change form as a browser posts it (the placements inline has no forms)."""
    form: dict[str, Any] = {
        "served_name": model.served_name,
        "runtime": model.runtime,
        "source_folder": model.source_folder,
        "source_file": model.source_file,
        "settings": "{}",
        "memory_budget_bytes": "",
        "load_timeout_seconds": str(model.load_timeout_seconds),
        "placements-TOTAL_FORMS": "0",
        "placements-INITIAL_FORMS": "0",
    }
    form.update(changes)
    return form


def _messages(answer: Any) -> list[str]:
    return [str(m) for m in answer.wsgi_request._messages]


@pytest.mark.django_db
def test_the_change_form_cannot_set_desired_state_or_bypass_the_checks(
    admin_client: Client,
) -> None:
    node = make_node("n1")
    model = make_model("m1", node=node)
    url = f"{LIST}{model.pk}/change/"
    answer = admin_client.post(
        url, _form(model, desired_state="running", delivery="container", estimate='{"x": 1}')
    )
    assert answer.status_code == 302, answer.content[:2000]
    after = ModelDefinition.objects.get(pk=model.pk)
    assert (after.desired_state, after.delivery, after.estimate) == ("stopped", "process", {})
    assert after.settings["extra_args"] == []  # saved through the typed settings

    # What /api refuses, the admin refuses, naming the field (the service's own words).
    refusals = {
        "settings": '{"extra_args": ["--rpc", "10.0.0.1:50052"]}',
        "served_name": "two words",
        "source_file": "../../etc/passwd",
        "runtime": "tgi",
        "memory_budget_bytes": "-5",
        "idle_unload_seconds": "5",  # services.SERVING_FIELDS: from 10
    }
    for field, value in refusals.items():
        answer = admin_client.post(url, _form(model, **{field: value}))
        assert answer.status_code == 200, (field, answer.status_code)
        errors = answer.context["adminform"].form.errors
        assert field in errors, (field, errors)
    saved = ModelDefinition.objects.get(pk=model.pk)
    assert (saved.settings, saved.served_name, saved.runtime) == (after.settings, "m1", "llamacpp")
    assert saved.memory_budget_bytes is None

    # A good change goes through, settings normalised by the typed settings.
    answer = admin_client.post(url, _form(model, settings='{"context_size": 512}'))
    assert answer.status_code == 302
    assert ModelDefinition.objects.get(pk=model.pk).settings["context_size"] == 512


@pytest.mark.django_db
def test_placements_are_shown_not_changed(admin_client: Client) -> None:
    node = make_node("n1")
    other = make_node("n2", approved=False)
    model = make_model("m1", node=node)
    (placement,) = Placement.objects.filter(model=model)
    page = admin_client.get(f"{LIST}{model.pk}/change/")
    assert page.status_code == 200
    assert placement.instance_id.encode() in page.content
    form = _form(
        model,
        **{
            "placements-TOTAL_FORMS": "2",
            "placements-INITIAL_FORMS": "1",
            "placements-0-id": str(placement.pk),
            "placements-0-model": str(model.pk),
            "placements-0-node": str(node.pk),
            "placements-0-DELETE": "on",
            "placements-1-model": str(model.pk),
            "placements-1-node": str(other.pk),
            "placements-1-gpu_uuids": '["GPU-evil"]',
        },
    )
    admin_client.post(f"{LIST}{model.pk}/change/", form)
    assert list(Placement.objects.values_list("node__node_id", "gpu_uuids")) == [("n1", [])]


@pytest.mark.django_db
def test_a_model_added_in_the_admin_is_created_by_the_service(admin_client: Client) -> None:
    bad = {"served_name": "bad name", "runtime": "llamacpp", "source_folder": "f",
           "source_file": "m.gguf", "settings": "{}", "memory_budget_bytes": "",
           "placements-TOTAL_FORMS": "0", "placements-INITIAL_FORMS": "0"}  # fmt: skip
    answer = admin_client.post(f"{LIST}add/", bad)
    assert answer.status_code == 200
    assert "served_name" in answer.context["adminform"].form.errors
    assert not ModelDefinition.objects.exists()
    answer = admin_client.post(f"{LIST}add/", bad | {"served_name": "good", "settings": "null"})
    assert answer.status_code == 302, answer.content[:2000]
    created = ModelDefinition.objects.get(served_name="good")
    assert (created.desired_state, created.delivery) == ("stopped", "process")
    assert created.settings == ModelDefinition.objects.get(pk=created.pk).settings


@pytest.mark.django_db
def test_the_model_list_shows_the_live_state(admin_client: Client, status_redis: object) -> None:
    up = make_node("n1")
    down = make_node("n2")
    ready = make_model("ready", node=up)
    failed = make_model("failed", node=up)
    make_model("offline", node=down)
    make_model("unplaced")
    instances = {
        f"m{ready.pk}-p{ready.placements.get().pk}": {"state": "Ready"},
        f"m{failed.pk}-p{failed.placements.get().pk}": {"state": "Failed", "error": "exit 1"},
    }
    set_status(up, "Online", instances=instances)
    page = admin_client.get(LIST)
    assert page.status_code == 200
    states = {
        n: _cell(page.content, n, "state") for n in ("ready", "failed", "offline", "unplaced")
    }
    assert states == {
        "ready": "Ready",
        "failed": "Failed: exit 1",
        "offline": "Offline",
        "unplaced": "Unplaced",
    }
    assert _cell(page.content, "ready", "replicas") == "n1"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query",
    ["?q=ready", "?q=%25%27%22%3Cscript%3E", "?q=" + "y" * 3000, "?desired_state__exact=running",
     "?runtime__exact=llamacpp", "?auto_start__exact=1", "?placements__node__id__exact=1",
     "?desired_state__exact=%00", "?o=-3.1"],
)  # fmt: skip
def test_model_list_queries_never_500(admin_client: Client, query: str) -> None:
    make_model("ready", node=make_node("n1"))
    answer = admin_client.get(f"{LIST}{query}")
    if "%00" in query:  # refused before the admin runs (mirbad_site/nul_guard.py)
        assert answer.status_code == 400 and b"NUL character" in answer.content
        return
    assert answer.status_code in (200, 302), answer.content[:500]


@pytest.mark.django_db
def test_restart_is_a_lifecycle_action_and_keeps_a_refused_model_running(
    admin_client: Client,
) -> None:
    node = make_node("n1", draining=True)
    model = make_model("m1", node=node)
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="running")
    answer = _act(admin_client, LIST, "restart", model.pk)
    assert any("m1: Node 'n1' is draining; no new starts." in m for m in _messages(answer))
    assert ModelDefinition.objects.get(pk=model.pk).desired_state == "running"


@pytest.mark.django_db
def test_a_running_model_is_not_deleted(admin_client: Client) -> None:
    model = make_model("m1")
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="running")
    assert admin_client.get(f"{LIST}{model.pk}/delete/").status_code == 403
    assert admin_client.post(f"{LIST}{model.pk}/delete/", {"post": "yes"}).status_code == 403
    _act(admin_client, LIST, "delete_selected", model.pk)
    assert ModelDefinition.objects.filter(pk=model.pk).exists()
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="stopped")
    assert admin_client.post(f"{LIST}{model.pk}/delete/", {"post": "yes"}).status_code == 302
    assert not ModelDefinition.objects.filter(pk=model.pk).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("url", [LIST, "/admin/models_registry/modeldefinition/add/"])
def test_the_model_admin_refuses_anyone_but_staff(url: str, viewer: Any) -> None:
    make_model("secret-model")
    non_staff = Client()
    non_staff.force_login(viewer)
    for answer in (Client().get(url), non_staff.get(url)):
        assert answer.status_code == 302 and answer["Location"].startswith("/admin/login/")
        assert b"secret-model" not in answer.content
    model = ModelDefinition.objects.get(served_name="secret-model")
    non_staff.post(f"{LIST}{model.pk}/change/", _form(model, served_name="renamed"))
    assert ModelDefinition.objects.get(pk=model.pk).served_name == "secret-model"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_start_and_stop_actions_reach_the_agent(
    enrolled: Enrolled, admin_client: Client
) -> None:
    """Against a real in-process agent: the admin's actions are the lifecycle's commands."""
    await connect(enrolled)
    model = await sync_to_async(define)(enrolled)
    await sync_to_async(Node.objects.filter(node_id="n1").update)(memory_reserve_bytes=2**49)
    act = sync_to_async(_act)

    refused = _messages(await act(admin_client, LIST, "start", model.pk))
    # Admission's own refusal, with its numbers: the agent was asked for the header.
    assert any("tiny: " in m and "after the 524288.0 GiB reserve" in m for m in refused), refused
    assert enrolled.server.runtime.list() == []
    saved = await sync_to_async(ModelDefinition.objects.get)(pk=model.pk)
    assert saved.desired_state == "stopped"
    assert saved.estimate["architecture"] == "llama"  # read from the agent

    # Stop asks the agent, which never ran it ("already stopped"), and records the wish.
    await sync_to_async(ModelDefinition.objects.filter(pk=model.pk).update)(desired_state="running")
    stopped = _messages(await act(admin_client, LIST, "stop", model.pk))
    assert "Stopped: tiny" in stopped, stopped
    saved = await sync_to_async(ModelDefinition.objects.get)(pk=model.pk)
    assert saved.desired_state == "stopped"

    # The agent gone: the stop is refused, and nothing is assumed.
    await sync_to_async(ModelDefinition.objects.filter(pk=model.pk).update)(desired_state="running")
    await enrolled.server.stop()
    gone = _messages(await act(admin_client, LIST, "stop", model.pk))
    assert any(m.startswith("tiny: ") for m in gone), gone
    saved = await sync_to_async(ModelDefinition.objects.get)(pk=model.pk)
    assert saved.desired_state == "running"
