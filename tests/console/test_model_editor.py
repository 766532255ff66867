"""The model editor (issue 14): create and edit through the services, errors next to the
fields with nothing saved, and the live estimate of an unsaved form per GPU."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from models_registry import drafts
from models_registry.models import ModelDefinition
from nodes import status_cache
from nodes.models import Node
from nodes.monitor import NodeWorker
from protocol.tinygguf import write_tiny_gguf
from tests.factories import make_model, make_node, set_status
from tests.nodes.conftest import Enrolled

GIB = 2**30
GPU = "GPU-aaaaaaaa-0000-0000-0000-000000000001"


@pytest.fixture(autouse=True)
def _no_cached_headers() -> Any:
    drafts.forget_headers()
    yield
    drafts.forget_headers()


def as_operator(user: object) -> Client:
    client = Client()
    client.force_login(user)  # type: ignore[arg-type]
    return client


def form(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "served_name": "qwen3",
        "source_kind": "folder",
        "source_node": "a",
        "source_folder": "qwen3",
        "source_file": "qwen3-Q4_K_M.gguf",
        "context_size": "8192",
        "parallel": "2",
        "gpu_layers": "999",
        "flash_attention": "auto",
        "cache_type_k": "q8_0",
        "cache_type_v": "q8_0",
        "reasoning": "auto",
        "causal_attention": "on",
        "emulate_dimensions": "on",
        "extra_args": "--top-k\n40\n",
        "place": ["a"],
        "gpus-a": [GPU],
    }
    values.update(changes)
    return {k: v for k, v in values.items() if v is not None}


def field_error(html: str, field: str) -> str:
    found = re.findall(rf'<span class="error field-error" data-field="{field}">([^<]*)<', html)
    return " ".join(found)


@pytest.mark.django_db
def test_the_estimate_endpoint_needs_an_operator(viewer) -> None:
    for client in (Client(), as_operator(viewer)):
        answer = client.post("/models/estimate/", "{}", content_type="application/json")
        assert answer.status_code == 302 and answer["Location"].startswith("/login/")


@pytest.mark.django_db
def test_create_and_edit_through_the_services(operator, status_redis) -> None:
    make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    make_node("b")
    client = as_operator(operator)
    page = client.get("/models/new/").content.decode()
    assert 'id="id_context_size"' in page and 'id="estimate"' in page
    assert 'value="a"' in page and f'value="{GPU}"' in page

    answer = client.post("/models/new/", form(**{f"budget-a-{GPU}": "6.5"}))
    assert answer.status_code == 302, answer.content.decode()[:2000]
    model = ModelDefinition.objects.get(served_name="qwen3")
    assert answer["Location"] == f"/models/{model.pk}/"
    assert model.settings["context_size"] == 8192 and model.settings["parallel"] == 2
    assert model.settings["cache_type_k"] == "q8_0"
    assert model.settings["extra_args"] == ["--top-k", "40"]
    assert model.settings["batch_size"] is None and model.settings["embedding"] is False
    placement = model.placements.get()
    assert (placement.node.node_id, placement.gpu_uuids) == ("a", [GPU])
    assert placement.gpu_budgets == [int(6.5 * GIB)]
    assert "Created model &#x27;qwen3&#x27;." in client.get(answer["Location"]).content.decode()

    # The editor shows what is saved; a change keeps the placement's row (its instance id).
    page = client.get(f"/models/{model.pk}/edit/").content.decode()
    assert 'name="context_size" value="8192"' in page
    assert f'name="budget-a-{GPU}" value="6.50"' in page
    answer = client.post(
        f"/models/{model.pk}/edit/",
        form(context_size="4096", place=["a", "b"], **{f"budget-a-{GPU}": "6.5"}),
    )
    assert answer.status_code == 302 and answer["Location"] == f"/models/{model.pk}/"
    model.refresh_from_db()
    assert model.settings["context_size"] == 4096
    assert [p.node.node_id for p in model.placements.all()] == ["a", "b"]
    assert model.placements.get(node__node_id="a").pk == placement.pk
    assert client.get("/models/99999/edit/").status_code == 404


@pytest.mark.django_db
def test_bad_values_come_back_next_to_their_fields_and_nothing_is_saved(
    operator, status_redis
) -> None:
    make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    make_model("taken")
    client = as_operator(operator)
    cases = [
        (form(context_size="8"), "context_size", "must be between 16 and 4194304"),
        (form(context_size="lots"), "context_size", "Enter a whole number."),
        (form(cache_type_k="q3"), "cache_type_k", "must be one of"),
        (form(served_name="has space"), "served_name", "use 1-200 letters"),
        (form(served_name="taken"), "served_name", "already used by another model"),
        (form(source_folder="../etc"), "source_folder", "use 1-200 letters, digits"),
        (form(source_file="model.bin"), "source_file", "name a .gguf file"),
        (form(extra_args="--model\n/etc/passwd"), "extra_args", "extra_args: argument 0"),
        (form(memory_budget_gib="-1"), "memory_budget_gib", "must be a positive byte count"),
    ]
    for values, field, expected in cases:
        answer = client.post("/models/new/", values)
        html = answer.content.decode()
        assert answer.status_code == 400, field
        assert expected in field_error(html, field), (field, field_error(html, field))
        # The form keeps what was typed.
        assert 'value="qwen3-Q4_K_M.gguf"' in html or field == "source_file"
    placement_cases = [
        (form(**{"gpus-a": ["GPU-bbbbbbbb-0000-0000-0000-000000000009"]}), "has no GPU"),
        (form(place=["ghost"]), "Node &#x27;ghost&#x27; does not exist."),
        (form(**{f"budget-a-{GPU}": "lots"}), "the budget &#x27;lots&#x27; is not a number"),
    ]
    for values, expected in placement_cases:
        answer = client.post("/models/new/", values)
        html = answer.content.decode()
        assert answer.status_code == 400
        assert 'id="placement-errors"' in html, expected
        errors = html.split('id="placement-errors"', 1)[1].split("</ul>", 1)[0]
        assert expected in errors, html[:3000]
    assert list(ModelDefinition.objects.values_list("served_name", flat=True)) == ["taken"]


@pytest.mark.django_db
def test_the_estimate_refuses_bad_input_with_a_400_naming_it(operator, status_redis) -> None:
    make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    client = as_operator(operator)
    good = {"sourceFolder": "f", "sourceFile": "m.gguf", "settings": {}, "placements": []}

    def post(raw: str) -> tuple[int, str]:
        answer = client.post("/models/estimate/", raw, content_type="application/json")
        assert answer["Content-Type"] == "application/json"
        return answer.status_code, answer.json()["error"]["message"]

    cases = [
        ("{not json", "The body is not JSON"),
        ("[" * 100_000 + "]" * 100_000, "nests arrays or objects too deeply"),
        ('"\\ud800"', "must be text: no lone surrogate"),
        ("[]", "The body must be a JSON object."),
        ("null", "The body must be a JSON object."),
        (json.dumps({**good, "servedName": "x"}), "servedName: unknown field"),
        (json.dumps({**good, "sourceFolder": 5}), "sourceFolder:"),
        (json.dumps({**good, "sourceFolder": ".."}), "sourceFolder:"),
        (json.dumps({**good, "sourceFile": None}), "source_file: name a .gguf file"),
        (json.dumps({**good, "settings": []}), "settings: must be an object"),
        (json.dumps({**good, "settings": {"context_size": "abc"}}), "settings.context_size:"),
        (json.dumps({**good, "settings": {"nope": 1}}), "settings.nope: unknown setting"),
        (json.dumps({**good, "memoryBudgetBytes": True}), "memoryBudgetBytes: must be"),
        (json.dumps({**good, "memoryBudgetBytes": -5}), "memoryBudgetBytes: must be"),
        (json.dumps({**good, "modelId": "1"}), "modelId: must be a model id"),
        (json.dumps({**good, "modelId": 4242}), "modelId: model 4242 does not exist"),
        (json.dumps({**good, "sourceNode": 7}), "sourceNode: must be a node id"),
        (json.dumps({**good, "sourceNode": "ghost"}), "sourceNode: node 'ghost' does not exist"),
        (json.dumps({**good, "placements": "a"}), "placements: must be a list"),
        (json.dumps({**good, "placements": [5]}), "placements[0]: must be an object"),
        (json.dumps({**good, "placements": [{"node": 5}]}), "node: name the node id"),
        (json.dumps({**good, "placements": [{"node": "ghost"}]}), "Node 'ghost' does not exist"),
        (
            json.dumps({**good, "placements": [{"node": "a", "gpuUuids": ["GPU-x"]}]}),
            "gpuUuids: must be a list of distinct GPU UUIDs",
        ),
        (
            json.dumps(
                {**good, "placements": [{"node": "a", "gpuUuids": [GPU], "gpuBudgets": [1, 2]}]}
            ),
            "a partial per-GPU budget map is refused",
        ),
    ]
    for raw, expected in cases:
        status, message = post(raw)
        assert status == 400 and expected in message, (raw[:80], status, message)
    # A node that is not serving is that target's error, not a failed request.
    answer = client.post(
        "/models/estimate/", {**good, "sourceNode": "a"}, content_type="application/json"
    )
    assert answer.status_code == 200
    (target,) = answer.json()["targets"]
    assert target["error"] == "node a is Offline: its GGUF header cannot be read now"
    # The unsaved form is ranked too (suggest.suggest_for), with the reasons.
    (ranked,) = answer.json()["suggestions"]
    assert ranked["node"] == "a" and not ranked["suitable"]
    assert "not serving (state: Offline)" in ranked["reasons"]
    # Form-encoded or empty bodies are not JSON either.
    assert client.post("/models/estimate/", {"a": "b"}).status_code == 400
    assert client.get("/models/estimate/").status_code == 405


async def _connect(enrolled: Enrolled) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
    finally:
        await worker.client.aclose()


def _give_n1_a_gpu() -> None:
    """A 16 GiB card with 2.6 GiB used and a 2.5 GiB reserve: 10.9 GiB free after it."""
    Node.objects.filter(node_id="n1").update(
        facts={"gpus": [{"index": 1, "uuid": GPU}]}, gpu_reserves={GPU: int(2.5 * GIB)}
    )
    status = status_cache.read("n1") or {}
    telemetry = dict(status.get("telemetry") or {})
    telemetry["gpus"] = [
        {"index": 1, "uuid": GPU, "memoryTotalBytes": 16 * GIB,
         "memoryUsedBytes": int(2.6 * GIB)},
    ]  # fmt: skip
    status_cache.write({**status, "telemetry": telemetry})


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis")
async def test_the_estimate_reads_the_header_once_and_answers_a_line_per_gpu(
    enrolled: Enrolled, operator
) -> None:
    await _connect(enrolled)
    gguf = enrolled.server.config.models_root_path / "tiny" / "tiny.gguf"
    write_tiny_gguf(gguf)
    await sync_to_async(_give_n1_a_gpu)()
    client = await sync_to_async(as_operator)(operator)

    async def estimate(**changes: Any) -> dict[str, Any]:
        body = {
            "sourceFolder": "tiny",
            "sourceFile": "tiny.gguf",
            "settings": {"context_size": 256},
            "placements": [{"node": "n1", "gpuUuids": [GPU]}],
        } | changes
        answer = await sync_to_async(client.post)(
            "/models/estimate/", json.dumps(body), content_type="application/json"
        )
        assert answer.status_code == 200, answer.content
        result: dict[str, Any] = answer.json()
        return result

    (target,) = (await estimate())["targets"]
    assert "error" not in target, target
    (line,) = target["lines"]
    assert re.fullmatch(
        r"GPU 1: needs \d+\.\d GiB, 10\.9 GiB free after the 2\.5 GiB reserve - fits",
        line["text"],
    ), line["text"]
    assert target["breakdown"]["budget"] == target["budgetBytes"] > target["breakdown"]["weights"]
    assert target["breakdown"]["cuda_context"] > 0 and target["architecture"] == "llama"

    # A bigger context changes the KV part; a budget by hand that does not fit says so.
    (bigger,) = (await estimate(settings={"context_size": 4096}))["targets"]
    assert bigger["breakdown"]["kv"] > target["breakdown"]["kv"]
    (manual,) = (await estimate(memoryBudgetBytes=12 * GIB))["targets"]
    assert manual["budgetSource"] == "manual" and manual["fits"] is False
    assert manual["lines"][0]["text"] == (
        "GPU 1: needs 12.0 GiB, 10.9 GiB free after the 2.5 GiB reserve - does not fit"
    )
    # Without a placement: the host memory of the source node.
    (host,) = (await estimate(placements=[], sourceNode="n1"))["targets"]
    assert host["gpus"] == 0 and host["lines"][0]["text"].startswith("host memory: needs ")

    # The header is cached per node, folder and file: typing does not ask the agent again.
    gguf.unlink()
    (cached,) = (await estimate(settings={"context_size": 512}))["targets"]
    assert "error" not in cached
    drafts.forget_headers()
    (gone,) = (await estimate())["targets"]
    assert "does not hold tiny/tiny.gguf" in gone["error"]


@pytest.mark.django_db
def test_an_edited_models_own_instance_is_marked_running(operator, status_redis) -> None:
    """modelId skips the model's own Starting budget and marks a running replica."""
    node = make_node("n1")
    model = make_model("m", node)
    placement = model.placements.get()
    set_status(node, "Online", {placement.instance_id: {"state": "Ready"}})
    client = as_operator(operator)
    body = {"modelId": model.pk, "sourceFolder": "f", "sourceFile": "m.gguf",
            "placements": [{"node": "n1"}]}  # fmt: skip
    answer = client.post("/models/estimate/", body, content_type="application/json")
    (target,) = answer.json()["targets"]
    # The node has no agent: the header cannot be read, and the answer says so per node.
    assert answer.status_code == 200 and "n1" in target["error"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
@pytest.mark.timeout(60)
async def test_a_hugging_face_source_starts_its_download_on_save(
    enrolled: Enrolled, operator, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from models_registry import downloads
    from tests.fakehub import FakeHub

    gguf = write_tiny_gguf(tmp_path / "src.gguf").read_bytes()
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf, "README.md": b"# tiny\n"})
        await _connect(enrolled)
        client = await sync_to_async(as_operator)(operator)
        values = form(
            served_name="tiny", source_kind="huggingface", source_node="n1",
            source_folder="tiny", source_file="", hf_repo="org/tiny-GGUF",
            hf_variant="tiny-Q9.gguf", place=["n1"], **{"gpus-a": None},
        )  # fmt: skip
        # A variant the repo does not have: said next to the field, nothing saved or fetched.
        refused = await sync_to_async(client.post)("/models/new/", values)
        assert refused.status_code == 400
        assert "is not a GGUF variant of org/tiny-GGUF" in field_error(
            refused.content.decode(), "hf_variant"
        )
        assert not await sync_to_async(ModelDefinition.objects.exists)()

        values["hf_variant"] = "tiny-Q8_0.gguf"
        answer = await sync_to_async(client.post)("/models/new/", values)
        assert answer.status_code == 302, answer.content.decode()[:3000]
        model = await sync_to_async(ModelDefinition.objects.get)(served_name="tiny")
        assert (model.source_folder, model.source_file) == ("tiny", "tiny-Q8_0.gguf")
        page = (await sync_to_async(client.get)(answer["Location"])).content.decode()
        assert "Download of org/tiny-GGUF (tiny-Q8_0.gguf) into &#x27;tiny&#x27; started" in page
        listed = await sync_to_async(downloads.list_downloads)("n1")
        assert [d["folder"] for d in listed["downloads"]] == ["tiny"]
        # Let the node finish before the hub goes away.
        target = enrolled.server.config.models_root_path / "tiny" / "tiny-Q8_0.gguf"
        for _ in range(200):
            if target.exists():
                break
            await asyncio.sleep(0.05)
        assert target.read_bytes() == gguf
