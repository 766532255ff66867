"""The serving policy's fields on /api/models, and load on demand's lifecycle side
(models_registry/ondemand.py): the eviction choice, start with room made, idle unload.

The lifecycle's start and stop are replaced by recorders here (they are tested against
a real agent in test_lifecycle.py and end to end in tests/e2e/test_ondemand.py); the
node statuses are real status-cache records.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from rest_framework.test import APIClient

from core.errors import ServiceError
from models_registry import lifecycle, ondemand
from models_registry.models import ModelDefinition
from models_registry.ondemand import Usage
from nodes.models import AuditEvent, Node
from tests.factories import make_model, make_node, set_status

NOW = time.time()  # the fleet's clock; start_on_demand reads the real one


# -- the fields on /api/models ---------------------------------------------------------


def _create(client: APIClient, **extra: Any) -> Any:
    body = {"servedName": "od", "sourceFolder": "f", "sourceFile": "m.gguf", **extra}
    return client.post("/api/models", body, format="json")


@pytest.mark.django_db
def test_serving_fields_round_trip_in_camel_case(operator_client: APIClient) -> None:
    created = _create(operator_client, loadOnDemand=True, idleUnloadSeconds=600,
                      loadTimeoutSeconds=120, pinned=False, queueMaxLength=0,
                      queueTimeoutSeconds=30)  # fmt: skip
    assert created.status_code == 201, created.content
    body = created.json()
    assert {k: body[k] for k in ("loadOnDemand", "idleUnloadSeconds", "loadTimeoutSeconds",
                                 "pinned", "queueMaxLength", "queueTimeoutSeconds")} == {
        "loadOnDemand": True, "idleUnloadSeconds": 600, "loadTimeoutSeconds": 120,
        "pinned": False, "queueMaxLength": 0, "queueTimeoutSeconds": 30,
    }  # fmt: skip
    patched = operator_client.patch(
        f"/api/models/{body['id']}", {"idleUnloadSeconds": None, "pinned": True}, format="json"
    )
    assert patched.status_code == 200, patched.content
    assert patched.json()["idleUnloadSeconds"] is None and patched.json()["pinned"] is True
    assert patched.json()["loadTimeoutSeconds"] == 120  # untouched by a PATCH without it
    defaults = _create(operator_client, servedName="plain").json()
    assert defaults["loadOnDemand"] is False and defaults["loadTimeoutSeconds"] == 300
    assert defaults["queueMaxLength"] is None and defaults["idleUnloadSeconds"] is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("loadOnDemand", "yes", "loadOnDemand: must be true or false"),
        ("pinned", 1, "pinned: must be true or false"),
        ("loadOnDemand", None, "loadOnDemand: must be true or false"),
        ("idleUnloadSeconds", 5, "idleUnloadSeconds: must be a whole number of seconds from 10"),
        ("idleUnloadSeconds", 12.5, "or null (never unload)"),
        ("idleUnloadSeconds", True, "idleUnloadSeconds: must be a whole number"),
        ("loadTimeoutSeconds", None, "loadTimeoutSeconds: must be a whole number of seconds"),
        ("loadTimeoutSeconds", 0, "from 1 to 3600"),
        ("loadTimeoutSeconds", "300", "loadTimeoutSeconds: must be a whole number"),
        ("queueMaxLength", -1, "queueMaxLength: must be a whole number of requests from 0 to"),
        ("queueMaxLength", 100_001, "100000, or null (MIRBAD_QUEUE_MAX)"),
        ("queueTimeoutSeconds", 3601, "queueTimeoutSeconds: must be a whole number of seconds"),
    ],
)
def test_bad_serving_fields_are_refused_naming_the_field(
    operator_client: APIClient, field: str, value: Any, says: str
) -> None:
    refused = _create(operator_client, **{field: value})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["code"] == "invalid_request"
    assert says in error["message"], error["message"]
    assert not ModelDefinition.objects.exists()


@pytest.mark.django_db
def test_serving_fields_without_permission(viewer_client: APIClient) -> None:
    model = make_model("od")
    refused = viewer_client.patch(f"/api/models/{model.pk}", {"pinned": True}, format="json")
    assert refused.status_code == 403
    model.refresh_from_db()
    assert model.pinned is False


@pytest.mark.django_db
def test_the_console_editor_saves_the_serving_fields(client: Any, operator: Any) -> None:
    client.force_login(operator)
    model = make_model("od", make_node("n1"))
    page = client.get(f"/models/{model.pk}/edit/")
    assert page.status_code == 200
    assert b'name="load_on_demand"' in page.content and b'name="pinned"' in page.content
    post = {
        "served_name": "od", "runtime": "llamacpp", "delivery": "process",
        "source_kind": "folder", "source_folder": "f", "source_file": "m.gguf",
        "context_size": 4096, "parallel": 1, "gpu_layers": 0, "flash_attention": "auto",
        "cache_type_k": "f16", "cache_type_v": "f16", "reasoning": "auto",
        "vllm_max_num_seqs": 64, "vllm_gpu_memory_utilization": 0.9, "vllm_dtype": "auto",
        "vllm_kv_cache_dtype": "auto", "place": ["n1"],
        "load_on_demand": "on", "idle_unload_seconds": "5", "load_timeout_seconds": "60",
    }  # fmt: skip
    refused = client.post(f"/models/{model.pk}/edit/", post)
    assert refused.status_code == 400
    assert "must be a whole number of seconds from 10" in refused.content.decode()
    saved = client.post(f"/models/{model.pk}/edit/", {**post, "idle_unload_seconds": "900"})
    assert saved.status_code == 302, saved.content.decode()[:2000]
    model.refresh_from_db()
    assert (model.load_on_demand, model.idle_unload_seconds, model.load_timeout_seconds) == (
        True, 900, 60,
    )  # fmt: skip
    shown = client.get(f"/models/{model.pk}/").content.decode()
    assert "loads on demand (a request waits up to 60 s)" in shown
    assert "unloaded after 900 s without a request" in shown


# -- eviction and idle unload -----------------------------------------------------------


def _iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat()


class Activity:
    """The router's readers, as the test sets them."""

    def __init__(self) -> None:
        self.busy: dict[str, int] = {}
        self.last: dict[str, float] = {}

    def usage(self) -> Usage:
        return Usage(busy=lambda n: self.busy.get(n, 0), last_used=self.last.get)


def _model(name: str, node: Node, **fields: Any) -> ModelDefinition:
    model = make_model(name, node)
    values = {"load_on_demand": True, "desired_state": "running", **fields}
    ModelDefinition.objects.filter(pk=model.pk).update(**values)
    model.refresh_from_db()
    return model


def _fleet(activity: Activity) -> dict[str, ModelDefinition]:
    """Models on n1: idle for 100 s, 500 s, pinned and idle 1000 s, busy and idle 2000 s,
    not on demand (idle 3000 s), Starting; and one on n2 idle 9000 s."""
    n1, n2 = make_node("n1"), make_node("n2")
    models = {
        "a": _model("a", n1),
        "b": _model("b", n1),
        "pinned": _model("pinned", n1, pinned=True),
        "busy": _model("busy", n1),
        "manual": _model("manual", n1, load_on_demand=False),
        "starting": _model("starting", n1),
        "elsewhere": _model("elsewhere", n2),
    }
    idle = {"a": 100, "b": 500, "pinned": 1000, "busy": 2000, "manual": 3000, "starting": 10,
            "elsewhere": 9000}  # fmt: skip
    instances: dict[str, dict[str, dict[str, Any]]] = {"n1": {}, "n2": {}}
    for name, model in models.items():
        placement = model.placements.get()
        state = "Starting" if name == "starting" else "Ready"
        instances[placement.node.node_id][placement.instance_id] = {
            "instanceId": placement.instance_id, "modelId": model.pk, "state": state,
            "readyAt": _iso(NOW - 20_000),
        }  # fmt: skip
        activity.last[name] = NOW - idle[name]
    activity.busy["busy"] = 1
    set_status(n1, instances=instances["n1"])
    set_status(n2, instances=instances["n2"])
    return models


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis")
def test_eviction_takes_the_longest_idle_never_pinned_busy_or_manual() -> None:
    activity = Activity()
    models = _fleet(activity)
    chosen = ondemand.eviction_candidates("n1", usage=activity.usage(), now=NOW)
    assert [c.model.served_name for c in chosen] == ["b", "a"]
    assert [round(c.idle_seconds) for c in chosen] == [500, 100]
    # The model being started is never its own victim.
    without_b = ondemand.eviction_candidates(
        "n1", usage=activity.usage(), exclude=models["b"].pk, now=NOW
    )
    assert [c.model.served_name for c in without_b] == ["a"]
    # Never used since it was loaded: idle since Ready, not since forever.
    activity.last.pop("a")
    idle = {c.model.served_name: c.idle_seconds for c in
            ondemand.eviction_candidates("n1", usage=activity.usage(), now=NOW)}  # fmt: skip
    assert idle["a"] == pytest.approx(20_000)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    calls: dict[str, list[Any]] = {"start": [], "stop": []}

    def stop_model(model_id: int, *, node_id: str | None = None) -> dict[str, Any]:
        calls["stop"].append((ModelDefinition.objects.get(pk=model_id).served_name, node_id))
        return {}

    monkeypatch.setattr(lifecycle, "stop_model", stop_model)
    return calls


def _refusing(calls: dict[str, list[Any]], refusals: int) -> Any:
    def start_model(model_id: int) -> dict[str, Any]:
        calls["start"].append(model_id)
        if len(calls["start"]) <= refusals:
            raise ServiceError(409, "admission_refused", "Model 'new' does not fit on node n1: "
                               "host memory: needs 2.0 GiB.", details={"node": "n1"})  # fmt: skip
        return {"modelId": model_id, "instances": []}

    return start_model


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis")
def test_a_start_that_does_not_fit_stops_the_longest_idle_and_says_so(
    monkeypatch: pytest.MonkeyPatch, recorded: dict[str, list[Any]]
) -> None:
    activity = Activity()
    _fleet(activity)
    new = _model("new", Node.objects.get(node_id="n1"))
    ModelDefinition.objects.filter(pk=new.pk).update(desired_state="stopped")
    # Refused twice: once before the stop, once while the node's memory is not yet updated.
    monkeypatch.setattr(lifecycle, "start_model", _refusing(recorded, 2))
    clock = [0.0]
    answer = ondemand.start_on_demand(
        new.pk, usage=activity.usage(), sleep=lambda s: clock.__setitem__(0, clock[0] + s),
        clock=lambda: clock[0],
    )  # fmt: skip
    assert answer["evicted"] == ["b"]
    assert recorded["stop"] == [("b", None)]  # its only replica: the whole model
    assert len(recorded["start"]) == 3
    note = ModelDefinition.objects.get(served_name="b").auto_start_note
    assert note.startswith("Stopped on n1 at ") and "made room for 'new'" in note, note
    assert "idle" in note
    event = AuditEvent.objects.get(action="model.unloaded")
    assert (event.subject, event.node_id, event.detail["reason"]) == ("b", "n1", "room")
    assert "made room for 'new'" in event.detail["why"]


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis")
def test_nothing_to_stop_keeps_admissions_refusal_and_says_why(
    monkeypatch: pytest.MonkeyPatch, recorded: dict[str, list[Any]]
) -> None:
    n1 = make_node("n1")
    pinned = _model("pinned", n1, pinned=True)
    placement = pinned.placements.get()
    set_status(n1, instances={placement.instance_id: {"state": "Ready", "readyAt": _iso(NOW)}})
    new = _model("new", n1)
    monkeypatch.setattr(lifecycle, "start_model", _refusing(recorded, 99))
    with pytest.raises(ServiceError) as refused:
        ondemand.start_on_demand(new.pk, usage=Activity().usage())
    assert refused.value.code == "admission_refused"
    assert "does not fit on node n1" in refused.value.message
    assert "No idle on-demand model there could be stopped" in refused.value.message
    assert recorded["stop"] == []


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis")
def test_idle_unload_stops_only_what_was_idle_long_enough(
    recorded: dict[str, list[Any]],
) -> None:
    activity = Activity()
    _fleet(activity)
    # a: idle 100 s of 60 -> stopped; b: idle 500 s of 900 -> kept; pinned: kept;
    # busy: a request in flight -> kept; manual (not on demand) idle 3000 of 60 -> stopped.
    for name, seconds in (("a", 60), ("b", 900), ("pinned", 10), ("busy", 10), ("manual", 60),
                          ("starting", 10)):  # fmt: skip
        ModelDefinition.objects.filter(served_name=name).update(idle_unload_seconds=seconds)
    out = ondemand.unload_idle(usage=activity.usage(), now=NOW)
    assert sorted(o["model"] for o in out) == ["a", "manual"]
    assert sorted(recorded["stop"]) == [("a", None), ("manual", None)]
    events = AuditEvent.objects.filter(action="model.unloaded").order_by("subject")
    assert [(e.subject, e.detail["reason"]) for e in events] == [("a", "idle"), ("manual", "idle")]
    assert "no request for 100 s (idleUnloadSeconds 60)" in events[0].detail["why"]
    note = ModelDefinition.objects.get(served_name="a").auto_start_note
    assert "no request for 100 s" in note


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis")
def test_idle_unload_counts_from_ready_when_never_used(recorded: dict[str, list[Any]]) -> None:
    n1 = make_node("n1")
    model = _model("fresh", n1, idle_unload_seconds=60)
    placement = model.placements.get()
    set_status(n1, instances={placement.instance_id: {"state": "Ready",
                                                      "readyAt": _iso(time.time() - 30)}})  # fmt: skip
    assert ondemand.unload_idle(usage=Activity().usage()) == []
    assert ondemand.unload_idle(usage=Activity().usage(), now=time.time() + 40) != []
