"""Start, restart, admission and auto-start through /api against a real in-process agent."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from rest_framework.test import APIClient

from agent.engines._spec import fingerprint, parse_launch_spec
from models_registry import lifecycle
from models_registry.models import MemorySample, ModelDefinition, Placement
from nodes.models import Node
from nodes.monitor import NodeWorker
from protocol.tinygguf import write_tiny_gguf
from tests.factories import make_model, make_node, set_status
from tests.nodes.conftest import Enrolled

GIB = 1024**3


async def connect(enrolled: Enrolled) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()  # Online, features and memory in the status cache
    finally:
        await worker.client.aclose()


def define(enrolled: Enrolled, **extra: Any) -> ModelDefinition:
    root = enrolled.server.config.models_root_path
    write_tiny_gguf(root / "tiny" / "tiny.gguf")
    model = ModelDefinition.objects.create(
        served_name="tiny",
        source_folder="tiny",
        source_file="tiny.gguf",
        settings={"context_size": 256},
        **extra,
    )
    Placement.objects.create(model=model, node=Node.objects.get(node_id="n1"))
    return model


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_admission_refuses_with_numbers_and_force_skips_only_memory(
    enrolled: Enrolled, operator_client: APIClient
) -> None:
    await connect(enrolled)
    model = await sync_to_async(define)(enrolled)
    await sync_to_async(Node.objects.filter(node_id="n1").update)(memory_reserve_bytes=2**49)
    post = sync_to_async(operator_client.post)

    estimate = (await sync_to_async(operator_client.get)(f"/api/models/{model.pk}/estimate")).json()
    (placement,) = estimate["placements"]
    assert placement["breakdown"]["budget"] == placement["budgetBytes"] > 0
    assert placement["fits"] is False
    assert "free after the 524288.0 GiB reserve - does not fit" in placement["lines"][0]["text"]

    refused = await post(f"/api/models/{model.pk}/start", {}, format="json")
    assert refused.status_code == 409, refused.json()
    error = refused.json()["error"]
    assert error["code"] == "admission_refused"
    assert "host memory: needs 0." in error["message"]
    assert "after the 524288.0 GiB reserve" in error["message"]
    assert enrolled.server.runtime.list() == []  # nothing was sent

    # force passes admission; the agent then refuses for its own reason (no engine here).
    forced = await post(f"/api/models/{model.pk}/start", {"force": True}, format="json")
    assert forced.json()["error"]["code"] != "admission_refused"
    assert forced.status_code in (409, 422, 503)

    await sync_to_async(Node.objects.filter(node_id="n1").update)(memory_reserve_bytes=0)
    fits = await post(f"/api/models/{model.pk}/start", {}, format="json")
    assert fits.json()["error"]["code"] != "admission_refused"
    saved = await sync_to_async(ModelDefinition.objects.get)(pk=model.pk)
    assert saved.estimate["budgetBytes"] == placement["budgetBytes"]
    assert saved.estimate["architecture"] == "llama"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_auto_start_leaves_a_model_that_does_not_fit_stopped_and_says_why(
    enrolled: Enrolled,
) -> None:
    await connect(enrolled)
    model = await sync_to_async(define)(enrolled, auto_start=True, desired_state="running")
    await sync_to_async(Node.objects.filter(node_id="n1").update)(memory_reserve_bytes=2**49)
    outcomes = await sync_to_async(lifecycle.autostart_node)("n1")
    assert outcomes == [
        {"model": "tiny", "started": False, "reason": outcomes[0]["reason"]},
    ]
    assert "does not fit on node n1" in outcomes[0]["reason"]
    saved = await sync_to_async(ModelDefinition.objects.get)(pk=model.pk)
    assert saved.auto_start_note.startswith("Auto-start on n1 left it stopped: Model 'tiny'")
    # A model not marked auto-start, or stopped by the operator, is never touched.
    await sync_to_async(ModelDefinition.objects.filter(pk=model.pk).update)(desired_state="stopped")
    assert await sync_to_async(lifecycle.autostart_node)("n1") == []


@pytest.mark.django_db
def test_restart_pending_compares_the_agents_own_fingerprint() -> None:
    node = make_node("n1")
    model = make_model("m", node)
    placement = model.placements.get()
    spec = lifecycle.launch_spec(model, placement)
    running = {
        "state": "Ready",
        "fingerprint": fingerprint(parse_launch_spec(spec), "0.6.0-dev"),
        "executable": {"name": "llama.cpp", "version": "0.6.0-dev"},
    }
    assert not lifecycle.restart_pending(model, placement, running)
    model.settings = {"context_size": 8192}
    assert lifecycle.restart_pending(model, placement, running)
    model.settings = {}
    model.executable_version = "0.7.0"  # a pinned version the node does not run
    assert lifecycle.restart_pending(model, placement, running)
    assert not lifecycle.restart_pending(model, placement, {**running, "state": "Stopped"})


@pytest.mark.django_db
def test_gpu_placement_pins_devices_in_the_spec() -> None:
    uuid = "GPU-12345678-aaaa-bbbb-cccc-000000000000"
    node = make_node("g1", facts={"gpus": [{"index": 0, "uuid": uuid}]})
    model = make_model("g", None)
    Placement.objects.create(model=model, node=node, gpu_uuids=[uuid])
    spec = lifecycle.launch_spec(model, model.placements.get())
    assert spec["gpuUuids"] == [uuid]
    args = spec["args"]
    assert args[args.index("--device") + 1] == "CUDA0" and "--split-mode" in args


@pytest.mark.django_db
def test_placements_api_replicas_and_gpu_checks(operator_client: APIClient) -> None:
    uuid = "GPU-12345678-aaaa-bbbb-cccc-000000000000"
    make_node("a", facts={"gpus": [{"index": 0, "uuid": uuid}]})
    make_node("b")
    body = {
        "servedName": "r",
        "sourceFolder": "f",
        "sourceFile": "m.gguf",
        "placements": [{"node": "a", "gpuUuids": [uuid]}, {"node": "b"}],
    }
    created = operator_client.post("/api/models", body, format="json")
    assert created.status_code == 201, created.json()
    placements = created.json()["placements"]
    assert [(p["node"], p["gpuUuids"]) for p in placements] == [("a", [uuid]), ("b", [])]

    def error(placements: Any) -> str:
        response = operator_client.patch(
            f"/api/models/{created.json()['id']}", {"placements": placements}, format="json"
        )
        assert response.status_code == 400, response.json()
        return response.json()["error"]["message"]

    assert "has no GPU GPU-00000000-0000" in error(
        [{"node": "a", "gpuUuids": ["GPU-00000000-0000-0000-0000-000000000000"]}]
    )
    assert "listed twice" in error([{"node": "b"}, {"node": "b"}])
    assert "partial per-GPU budget map" in error(
        [{"node": "a", "gpuUuids": [uuid], "gpuBudgets": [1, 2]}]
    )
    # Removing a replica of a running model is refused; adding one keeps ids stable.
    model = ModelDefinition.objects.get(served_name="r")
    first_ids = sorted(p.instance_id for p in model.placements.all())
    model.desired_state = "running"
    model.save()
    refused = operator_client.patch(
        f"/api/models/{model.pk}", {"placements": [{"node": "a"}]}, format="json"
    )
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_running"
    assert sorted(p.instance_id for p in model.placements.all()) == first_ids


@pytest.mark.django_db
def test_reserves_api(operator_client: APIClient) -> None:
    uuid = "GPU-12345678-aaaa-bbbb-cccc-000000000000"
    make_node("a", facts={"gpus": [{"index": 0, "uuid": uuid}]})
    ok = operator_client.patch(
        "/api/nodes/a",
        {"memoryReserveBytes": GIB, "gpuReserves": {uuid: 2 * GIB}},
        format="json",
    )
    assert ok.status_code == 200, ok.json()
    assert ok.json()["memoryReserveBytes"] == GIB and ok.json()["gpuReserves"] == {uuid: 2 * GIB}
    bad = operator_client.patch("/api/nodes/a", {"gpuReserves": {"GPU-x": 1}}, format="json")
    assert bad.status_code == 400 and "has no GPU GPU-x" in bad.json()["error"]["message"]
    negative = operator_client.patch("/api/nodes/a", {"memoryReserveBytes": -1}, format="json")
    assert negative.status_code == 400
    assert operator_client.patch("/api/nodes/zz", {}, format="json").status_code == 404


@pytest.mark.django_db
def test_measurement_is_kept_once_per_start_and_flagged_over_budget(
    operator_client: APIClient, status_redis: object
) -> None:
    node = make_node("n1")
    model = make_model("m", node)
    model.estimate = {"budgetBytes": GIB, "architecture": "qwen3", "fileType": 7}
    model.save()
    instance = {
        "instanceId": model.placements.get().instance_id,
        "modelId": model.pk,
        "state": "Ready",
        "readyAt": "2026-12-01T10:00:00Z",
        "measured": {"bytes": int(1.5 * GIB), "kind": "rss", "at": "2026-12-01T10:00:01Z"},
    }
    assert lifecycle.record_measurement("n1", instance) is not None
    lifecycle.record_measurement("n1", instance)  # the same start again: one row
    assert MemorySample.objects.count() == 1
    set_status(node, "Online", {instance["instanceId"]: instance})
    body = operator_client.get(f"/api/models/{model.pk}").json()
    assert body["placements"][0]["overBudget"] == "uses 0.5 GiB more than its budget"
    accuracy = operator_client.get("/api/estimate-accuracy").json()["groups"]
    assert accuracy == [
        {
            "architecture": "qwen3",
            "fileType": "7",
            "kind": "rss",
            "samples": 1,
            "meanMeasuredOverBudget": 1.5,
            "maxMeasuredOverBudget": 1.5,
        }
    ]


@pytest.mark.django_db
def test_suggestions_rank_nodes_that_fit_and_hold_the_weights(
    operator_client: APIClient, status_redis: object
) -> None:
    a, b, c = make_node("a"), make_node("b"), make_node("c")
    model = make_model("m")
    model.estimate = {"budgetBytes": 3 * GIB, "breakdown": {"weights": 2 * GIB}}
    model.save()
    for node, available in ((a, 8), (b, 4), (c, 8)):
        set_status(node, "Online")
        from nodes import status_cache

        status = status_cache.read(node.node_id) or {}
        status["telemetry"]["memory"]["availableBytes"] = available * GIB  # type: ignore[index]
        status["telemetry"]["disks"] = [{"freeBytes": 100 * GIB}]  # type: ignore[index]
        if node is c:
            status["telemetry"]["weights"] = [{"folder": "f", "bytes": 1, "fetched": True}]  # type: ignore[index]
        status_cache.write(status)
    Node.objects.filter(node_id="b").update(memory_reserve_bytes=2 * GIB)
    body = operator_client.get(f"/api/models/{model.pk}/placement-suggestions").json()
    order = [s["node"] for s in body["suggestions"]]
    # c holds the weights (but no serving node can read them here, so the stored estimate
    # is used); a fits; b does not fit after its reserve.
    assert order == ["c", "a", "b"]
    assert body["suggestions"][2]["fits"] is False
    assert "needs 3.0 GiB, 2.0 GiB free after the 2.0 GiB reserve" in " ".join(
        body["suggestions"][2]["reasons"]
    )


@pytest.mark.django_db
def test_an_unanswered_command_is_504_outcome_unknown() -> None:
    from nodes.agent_client import AgentTimeout, AgentUnreachable

    node = make_node("n1")
    timeout = lifecycle.agent_error(node, AgentTimeout("node n1: no answer in time"))
    assert (timeout.status, timeout.code) == (504, "outcome_unknown")
    assert "Look at the node before retrying" in timeout.message
    refused = lifecycle.agent_error(node, AgentUnreachable("node n1: connection refused"))
    assert (refused.status, refused.code) == (503, "node_unreachable")


@pytest.mark.django_db
def test_vllm_suggestions_rank_nodes_by_their_gpu_share_and_offer(
    operator_client: APIClient, status_redis: object
) -> None:
    from nodes import status_cache

    gpu = "GPU-5c5c5c5c-aaaa-bbbb-cccc-dddddddddddd"
    offers = ["runtime.llamacpp.process", "runtime.llamacpp.container", "runtime.vllm.container"]
    big = make_node("big", facts={"features": offers})
    small = make_node("small", facts={"features": offers})
    plain = make_node("plain", facts={"features": ["runtime.llamacpp.process"]})
    cpu = make_node("cpu", facts={"features": offers})
    model = ModelDefinition.objects.create(
        served_name="qwen", runtime="vllm", delivery="container", image="vllm/vllm-openai:v0",
        source_folder="Qwen", source_file="", settings={"gpu_memory_utilization": 0.5},
    )  # fmt: skip
    for node, total, used in ((big, 80, 10), (small, 24, 16), (plain, 80, 0), (cpu, 0, 0)):
        set_status(node, "Online")
        status = status_cache.read(node.node_id) or {}
        if total:
            status["telemetry"]["gpus"] = [  # type: ignore[index]
                {"index": 0, "uuid": gpu, "name": "H100", "memoryTotalBytes": total * GIB,
                 "memoryUsedBytes": used * GIB}
            ]  # fmt: skip
        status_cache.write(status)
    body = operator_client.get(f"/api/models/{model.pk}/placement-suggestions").json()
    by_node = {s["node"]: s for s in body["suggestions"]}
    assert body["suggestions"][0]["node"] == "big"
    assert by_node["big"]["suitable"] and by_node["big"]["gpuUuids"] == [gpu]
    # Half of 24 GiB is 12 GiB, and 8 GiB are free: the share does not fit.
    assert not by_node["small"]["fits"]
    assert "needs 12.0 GiB" in " ".join(by_node["small"]["reasons"])
    assert not by_node["plain"]["suitable"]
    assert "does not offer vllm as a container" in by_node["plain"]["reasons"]
    assert "no GPU: vLLM needs GPUs" in by_node["cpu"]["reasons"]


@pytest.mark.django_db
def test_auto_start_of_a_node_with_nothing_to_start_is_one_query(
    django_assert_num_queries: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master restart asks this of every node: most have no auto-start model, and for
    them neither the node's row nor its status is read."""
    node = make_node("n1")
    make_model("plain", node)
    stopped = make_model("stopped", node)
    ModelDefinition.objects.filter(pk=stopped.pk).update(auto_start=True, desired_state="stopped")

    def no_read(*_: Any) -> None:
        raise AssertionError("the status was read")

    monkeypatch.setattr(lifecycle.node_status, "read", no_read)
    with django_assert_num_queries(1):
        assert lifecycle.autostart_node("n1") == []
    # A draining node starts nothing either, even with a model to start.
    draining = make_model("wanted", node)
    ModelDefinition.objects.filter(pk=draining.pk).update(auto_start=True, desired_state="running")
    Node.objects.filter(pk=node.pk).update(draining=True)
    with django_assert_num_queries(1):
        assert lifecycle.autostart_node("n1") == []
