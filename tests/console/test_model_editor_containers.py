"""Container models and vLLM in the console: the editor's Runtime and vLLM sections
through the services, each refusal on its field, the live estimate's per-GPU share of a
vLLM draft, and the runtime, delivery and image on the Models list and a model's page
(docs/decisions.md D65, D66, D89)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from models_registry import drafts, services
from models_registry.models import ModelDefinition, Placement
from nodes import status_cache
from nodes.models import Node
from tests.console.test_model_editor import as_operator, field_error, form
from tests.console.test_model_pages import cells
from tests.factories import make_model, make_node, set_status

GIB = 2**30
GPU = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
VLLM_IMAGE = "vllm/vllm-openai:v0.10.1"
DIGEST = "sha256:" + "ab" * 32
BOTH = ["runtime.llamacpp.process", "runtime.llamacpp.container", "runtime.vllm.container"]


@pytest.fixture(autouse=True)
def _no_cached_headers() -> Any:
    drafts.forget_headers()
    yield
    drafts.forget_headers()


def vllm_form(**changes: Any) -> dict[str, Any]:
    """A vLLM model in the editor: the llama.cpp section is posted too, as a browser
    posts every field, and must not count."""
    values: dict[str, Any] = {
        "runtime": "vllm",
        "delivery": "container",
        "image": VLLM_IMAGE,
        "source_file": "",
        "vllm_max_model_len": "8192",
        "vllm_max_num_seqs": "32",
        "vllm_gpu_memory_utilization": "0.5",
        "vllm_tensor_parallel_size": "",
        "vllm_dtype": "bfloat16",
        "vllm_quantization": "awq",
        "vllm_kv_cache_dtype": "fp8",
        "vllm_enable_prefix_caching": "off",
        "vllm_chat_template": "chat.jinja",
        "vllm_tool_call_parser": "hermes",
        "vllm_reasoning_parser": "qwen3",
        "vllm_extra_args": "--seed\n1\n",
        "context_size": "not a number",  # the other runtime's section
    }
    values.update(changes)
    return form(**values)


def gpu_node(node_id: str = "a", features: list[str] | None = None) -> Node:
    """A serving node with one 16 GiB card, 2.6 GiB used and a 2.5 GiB reserve."""
    node = make_node(
        node_id,
        facts={
            "gpus": [{"index": 1, "uuid": GPU}],
            "features": BOTH if features is None else features,
        },
        gpu_reserves={GPU: int(2.5 * GIB)},
    )
    status_cache.write(
        {
            "nodeId": node_id,
            "state": "Online",
            "reasons": [],
            "lastSeen": time.time(),
            "instances": {},
            "telemetry": {
                "gpus": [
                    {
                        "index": 1,
                        "uuid": GPU,
                        "memoryTotalBytes": 16 * GIB,
                        "memoryUsedBytes": int(2.6 * GIB),
                    },
                ],
            },
        }
    )
    return node


@pytest.mark.django_db
def test_a_llamacpp_container_model_is_saved_with_its_image(operator, status_redis) -> None:
    make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    client = as_operator(operator)
    page = client.get("/models/new/").content.decode()
    assert 'id="section-runtime"' in page and 'id="section-vllm"' in page
    assert '<option value="llamacpp" selected>llama.cpp</option>' in page
    assert "vLLM takes the whole folder: leave it empty" in page
    assert "name[:tag] or name@sha256:&lt;digest&gt;; the node runs it only if" in page
    image = f"ghcr.io/org/llama-server@{DIGEST}"
    answer = client.post("/models/new/", form(delivery="container", image=image))
    assert answer.status_code == 302, answer.content.decode()[:3000]
    model = ModelDefinition.objects.get(served_name="qwen3")
    assert (model.runtime, model.delivery, model.image) == ("llamacpp", "container", image)
    assert model.settings["context_size"] == 8192

    # Back to a process: the image typed before goes nowhere (a process has none).
    answer = client.post(f"/models/{model.pk}/edit/", form(delivery="process", image=image))
    assert answer.status_code == 302, answer.content.decode()[:3000]
    model.refresh_from_db()
    assert (model.delivery, model.image) == ("process", "")


@pytest.mark.django_db
def test_a_vllm_model_is_saved_with_its_settings_only(operator, status_redis) -> None:
    make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    client = as_operator(operator)
    answer = client.post("/models/new/", vllm_form())
    assert answer.status_code == 302, answer.content.decode()[:3000]
    model = ModelDefinition.objects.get(served_name="qwen3")
    assert (model.runtime, model.delivery, model.image) == ("vllm", "container", VLLM_IMAGE)
    assert model.source_file == ""  # the whole folder
    assert model.settings == {
        "max_model_len": 8192,
        "max_num_seqs": 32,
        "gpu_memory_utilization": 0.5,
        "tensor_parallel_size": None,
        "dtype": "bfloat16",
        "quantization": "awq",
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": False,
        "chat_template": "chat.jinja",
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
        "extra_args": ["--seed", "1"],
    }
    # Empty optional fields and "engine default" are vLLM's own defaults.
    answer = client.post(
        f"/models/{model.pk}/edit/",
        vllm_form(vllm_max_model_len="", vllm_quantization="", vllm_enable_prefix_caching=""),
    )
    assert answer.status_code == 302, answer.content.decode()[:3000]
    model.refresh_from_db()
    assert model.settings["max_model_len"] is None and model.settings["quantization"] is None
    assert model.settings["enable_prefix_caching"] is None


@pytest.mark.django_db
def test_each_refusal_is_shown_on_its_field_and_nothing_is_saved(operator, status_redis) -> None:
    make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    client = as_operator(operator)
    cases = [
        (vllm_form(delivery="process"), "delivery", "vLLM runs only in a container"),
        (form(delivery="container", image=""), "image", "must be a non-empty image reference"),
        (vllm_form(image=""), "image", "must be a non-empty image reference"),
        (form(delivery="container", image="Bad Image!"), "image", "is not an image reference"),
        (form(runtime="tgi"), "runtime", "use one of llamacpp, vllm"),
        (form(delivery="ship"), "delivery", "use one of process, container"),
        (
            vllm_form(vllm_gpu_memory_utilization="1.5"),
            "vllm_gpu_memory_utilization",
            "gpu_memory_utilization: must be a decimal number from 0.05 to 0.98",
        ),
        (vllm_form(vllm_gpu_memory_utilization="most"), "vllm_gpu_memory_utilization", "Enter a number."),
        (vllm_form(vllm_max_num_seqs="0"), "vllm_max_num_seqs", "max_num_seqs: must be"),
        (vllm_form(vllm_dtype="int3"), "vllm_dtype", "dtype: must be one of auto"),
        (vllm_form(vllm_enable_prefix_caching="maybe"), "vllm_enable_prefix_caching", "true, false or null"),
        (vllm_form(vllm_chat_template="../x.jinja"), "vllm_chat_template", "a path or a template text is refused"),
        (
            vllm_form(vllm_extra_args="--trust-remote-code"),
            "vllm_extra_args",
            "extra_args: argument 0: '--trust-remote-code' is not an allowed vLLM 0.x flag",
        ),
        # The llama.cpp section of a vLLM model keeps its own names.
        (form(chat_template="../x"), "chat_template", "chat_template:"),
    ]  # fmt: skip
    for values, field, expected in cases:
        answer = client.post("/models/new/", values)
        html = answer.content.decode()
        assert answer.status_code == 400, (field, expected)
        shown = field_error(html, field).replace("&#x27;", "'")
        assert expected in shown, (field, shown, re.findall(r"field-error[^>]*>[^<]*", html))
    assert not ModelDefinition.objects.exists()
    # The other runtime's section does not block a save, whichever way round.
    assert client.post("/models/new/", form(vllm_max_num_seqs="lots")).status_code == 302


@pytest.mark.django_db
def test_the_editor_shows_a_saved_vllm_models_values(operator, status_redis) -> None:
    node = make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    model = services.create_model(
        {
            "served_name": "qwen-vl",
            "runtime": "vllm",
            "image": VLLM_IMAGE,
            "source_folder": "qwen-vl",
            "source_file": "",
            "settings": {
                "max_num_seqs": 16,
                "gpu_memory_utilization": 0.45,
                "dtype": "half",
                "enable_prefix_caching": True,
                "tool_call_parser": "hermes",
                "extra_args": ["--seed", "7"],
            },
            "placements": [{"node": node.node_id, "gpuUuids": [GPU]}],
        }
    )
    html = as_operator(operator).get(f"/models/{model.pk}/edit/").content.decode()
    assert '<option value="vllm" selected>vLLM</option>' in html
    assert '<option value="container" selected>container</option>' in html
    assert f'name="image" value="{VLLM_IMAGE}"' in html
    assert 'name="vllm_max_num_seqs" value="16"' in html
    assert 'name="vllm_gpu_memory_utilization" value="0.45"' in html
    assert '<option value="half" selected>half</option>' in html
    assert '<option value="on" selected>on</option>' in html
    assert '<option value="hermes" selected>hermes</option>' in html
    assert re.search(r'name="vllm_extra_args"[^>]*>\s*--seed\n7</textarea>', html)
    assert 'name="vllm_max_model_len" id=' in html  # unset: empty
    # The llama.cpp section shows its defaults, not the vLLM values of the same names.
    assert 'name="context_size" value="4096"' in html
    assert re.search(r'name="extra_args"[^>]*>\s*</textarea>', html)
    # Suggestions rank GGUF estimates; a vLLM model says why it has none.
    assert "No suggestions for a vLLM model" in html


@pytest.mark.django_db
def test_the_estimate_of_a_vllm_draft_is_its_share_of_each_placed_gpu(
    operator, status_redis
) -> None:
    gpu_node("a")
    gpu_node("old", features=["runtime.llamacpp.process"])
    client = as_operator(operator)

    def estimate(**changes: Any) -> dict[str, Any]:
        body = {
            "runtime": "vllm",
            "delivery": "container",
            "image": VLLM_IMAGE,
            "sourceFolder": "qwen",
            "sourceFile": "",
            "settings": {"gpu_memory_utilization": 0.5},
            "placements": [{"node": "a", "gpuUuids": [GPU]}],
        } | changes
        answer = client.post("/models/estimate/", body, content_type="application/json")
        assert answer.status_code == 200, answer.content
        result: dict[str, Any] = answer.json()
        return result

    answer = estimate()
    (target,) = answer["targets"]
    assert "error" not in target, target
    assert target["runtime"] == "vllm" and target["budgetSource"] == "gpu-memory-utilization"
    assert target["gpuMemoryUtilization"] == 0.5
    assert target["gpuShares"] == [
        {"gpuUuid": GPU, "label": "GPU 1", "totalBytes": 16 * GIB, "budgetBytes": 8 * GIB}
    ]
    (line,) = target["lines"]
    assert line["text"] == "GPU 1: needs 8.0 GiB, 10.9 GiB free after the 2.5 GiB reserve - fits"
    assert target["fits"] is True and target["breakdown"] == {}
    assert answer["file"] == "qwen" and answer["suggestions"] == []
    assert answer["suggestionsNote"] == drafts.VLLM_SUGGESTIONS_NOTE

    # The share follows the setting, not the model: 0.9 of 16 GiB does not fit.
    (big,) = estimate(settings={"gpu_memory_utilization": 0.9})["targets"]
    assert big["lines"][0]["text"] == (
        "GPU 1: needs 14.4 GiB, 10.9 GiB free after the 2.5 GiB reserve - does not fit"
    )
    assert big["fits"] is False
    # A hand-set per-GPU budget does not change what vLLM takes.
    (hand,) = estimate(placements=[{"node": "a", "gpuUuids": [GPU], "gpuBudgets": [GIB]}])[
        "targets"
    ]
    assert hand["gpuShares"][0]["budgetBytes"] == 8 * GIB

    # What the start would refuse, per node: no GPUs, the runtime not offered, a tensor
    # parallel size that is not the number of placed GPUs.
    (bare,) = estimate(placements=[{"node": "a"}])["targets"]
    assert "runs on vLLM, which needs GPUs: place it on a with gpuUuids." in bare["error"]
    (source,) = estimate(placements=[], sourceNode="a")["targets"]
    assert "which needs GPUs" in source["error"]
    assert estimate(placements=[])["targets"] == []
    (old,) = estimate(placements=[{"node": "old", "gpuUuids": [GPU]}])["targets"]
    assert "Node old does not offer vllm as a container" in old["error"]
    (tp,) = estimate(settings={"tensor_parallel_size": 2})["targets"]
    assert "settings.tensor_parallel_size: is 2 but the placement pins 1 GPU(s)" in tp["error"]

    # The services judge the draft as they judge a save.
    def refused(**changes: Any) -> str:
        body = {"runtime": "vllm", "delivery": "container", "image": VLLM_IMAGE,
                "sourceFolder": "qwen", "settings": {}} | changes  # fmt: skip
        answer = client.post("/models/estimate/", body, content_type="application/json")
        assert answer.status_code == 400, answer.content
        return str(answer.json()["error"]["message"])

    assert "delivery: vLLM runs only in a container" in refused(delivery="process")
    assert "image: must be a non-empty image reference" in refused(image="")
    assert "runtime: use one of llamacpp, vllm" in refused(runtime="tgi")
    assert "settings.gpu_memory_utilization: must be a decimal number" in refused(
        settings={"gpu_memory_utilization": 1.5}
    )
    assert "settings.context_size: unknown setting" in refused(settings={"context_size": 512})
    # A llama.cpp model still needs its GGUF file.
    assert "source_file: name a .gguf file" in refused(
        runtime="llamacpp", delivery="process", image=""
    )


@pytest.mark.django_db
def test_a_llamacpp_draft_on_a_node_without_its_delivery_says_so(operator, status_redis) -> None:
    gpu_node("old", features=["runtime.llamacpp.process"])
    body = {"runtime": "llamacpp", "delivery": "container", "image": "llama:1",
            "sourceFolder": "f", "sourceFile": "m.gguf", "settings": {},
            "placements": [{"node": "old", "gpuUuids": [GPU]}]}  # fmt: skip
    answer = as_operator(operator).post("/models/estimate/", body, content_type="application/json")
    (target,) = answer.json()["targets"]
    assert "does not offer llamacpp as a container" in target["error"]
    assert "DockerEnabled" in target["error"]


def _container_model(node: Node) -> tuple[ModelDefinition, Placement]:
    model = ModelDefinition.objects.create(
        served_name="qwen-vl", runtime="vllm", delivery="container", image=VLLM_IMAGE,
        source_folder="qwen-vl", source_file="", settings={},
    )  # fmt: skip
    return model, Placement.objects.create(model=model, node=node, gpu_uuids=[GPU])


@pytest.mark.django_db
def test_the_model_page_and_list_show_runtime_delivery_and_image(operator, status_redis) -> None:
    node = make_node("n1", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    model, placement = _container_model(node)
    plain = make_model("plain", node)
    cid = "0123456789abcdef" * 4
    set_status(
        node,
        "Online",
        {placement.instance_id: {"state": "Ready", "delivery": "container", "containerId": cid}},
    )
    client = as_operator(operator)
    page = client.get(f"/models/{model.pk}/").content.decode()
    assert 'id="model-runtime">vLLM · container<' in page
    assert f'id="model-image"><code class="image">{VLLM_IMAGE}</code>' in page
    assert "<code>qwen-vl</code> <small>(the whole folder)</small>" in page
    assert "container <code>0123456789ab</code>" in page and cid[:13] not in page
    plain_page = client.get(f"/models/{plain.pk}/").content.decode()
    assert 'id="model-runtime">llama.cpp · process<' in plain_page
    assert 'id="model-image"' not in plain_page and "container <code>" not in plain_page

    html = client.get("/models/").content.decode()
    assert cells(html, model.pk)["runtime"] == f"vLLM · container {VLLM_IMAGE}"
    assert cells(html, plain.pk)["runtime"] == "llama.cpp · process"
    # The row models.js fetches is the list's row, cell for cell.
    fragment = client.get(f"/models/{model.pk}/row/").content.decode()
    assert cells(fragment, model.pk) == cells(html, model.pk)


@pytest.mark.django_db
def test_the_list_reads_the_runtime_without_a_query_per_row(operator, status_redis) -> None:
    node = make_node("n1", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    _container_model(node)
    client = as_operator(operator)
    client.get("/models/")  # the session and messages, once
    with CaptureQueriesContext(connection) as one:
        client.get("/models/")
    for i in range(3):
        model = make_model(f"more-{i}", node)
        ModelDefinition.objects.filter(pk=model.pk).update(
            delivery="container", image=f"ghcr.io/org/engine:{i}"
        )
    with CaptureQueriesContext(connection) as four:
        html = client.get("/models/").content.decode()
    assert "ghcr.io/org/engine:2" in html
    assert len(four) == len(one), [q["sql"] for q in four.captured_queries]


@pytest.mark.django_db
def test_a_viewer_cannot_save_a_container_model(viewer, status_redis) -> None:
    make_node("a", facts={"gpus": [{"index": 1, "uuid": GPU}]})
    for client in (Client(), as_operator(viewer)):
        answer = client.post("/models/new/", vllm_form())
        assert answer.status_code == 302 and answer["Location"].startswith("/login/")
        answer = client.post(
            "/models/estimate/", {"runtime": "vllm"}, content_type="application/json"
        )
        assert answer.status_code == 302 and answer["Location"].startswith("/login/")
    assert not ModelDefinition.objects.exists()
