"""Container models through /api/models: runtime, delivery and image judged at save; the
launch spec and the fingerprint a container start sends; the node's offer checked at start."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from core.errors import ServiceError
from models_registry import lifecycle, llamacpp
from models_registry.models import ModelDefinition, Placement
from tests.factories import make_node

pytestmark = pytest.mark.django_db

IMAGE = "vllm/vllm-openai@sha256:" + "ab" * 32
GPU = "GPU-5c5c5c5c-aaaa-bbbb-cccc-dddddddddddd"


@pytest.fixture
def admin_api(admin_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    return client


def create(client: APIClient, **fields: Any) -> Any:
    body = {"servedName": "box", "sourceFolder": "tiny", "sourceFile": "tiny.gguf", **fields}
    return client.post("/api/models", body, format="json")


@pytest.mark.parametrize(
    ("fields", "field", "needle"),
    [
        ({"runtime": "tgi"}, "runtime", "use one of llamacpp, vllm"),
        ({"runtime": "vllm", "delivery": "process"}, "delivery", "vLLM runs only in a container"),
        ({"delivery": "container"}, "image", "non-empty image reference"),
        ({"delivery": "container", "image": "Not An Image"}, "image", "not an image reference"),
        ({"delivery": "container", "image": "--privileged"}, "image", "not an image reference"),
        ({"image": "vllm/vllm-openai:v1"}, "image", "only a model with delivery 'container'"),
        ({"delivery": "docker"}, "delivery", "use one of process, container"),
        ({"runtime": "vllm", "image": IMAGE, "settings": {"gpu_memory_utilization": 1.5}},
         "settings.gpu_memory_utilization", ""),
        ({"runtime": "vllm", "image": IMAGE, "memoryBudgetBytes": 2**30},
         "memoryBudgetBytes", "gpu_memory_utilization"),
    ],
)  # fmt: skip
def test_what_a_container_model_may_be(
    admin_api: APIClient, fields: dict[str, Any], field: str, needle: str
) -> None:
    answer = create(admin_api, **fields)
    assert answer.status_code == 400, answer.json()
    error = answer.json()["error"]
    named = (error.get("details") or {}).get("field") or next(
        iter((error.get("details") or {}).get("fields") or {}), ""
    )
    assert named == field, error
    assert needle in error["message"], error
    assert not ModelDefinition.objects.exists()


def test_a_vllm_model_is_a_container_by_default_and_takes_the_whole_folder(
    admin_api: APIClient,
) -> None:
    answer = create(admin_api, runtime="vllm", image=IMAGE, sourceFile="")
    assert answer.status_code == 201, answer.json()
    body = answer.json()
    assert (body["runtime"], body["delivery"], body["image"], body["sourceFile"]) == (
        "vllm", "container", IMAGE, "",
    )  # fmt: skip


def test_a_container_launch_spec_and_its_fingerprint() -> None:
    node = make_node("n1", facts={"features": ["runtime.llamacpp.container"]})
    model = ModelDefinition.objects.create(
        served_name="box", runtime="llamacpp", delivery="container", image="engine:1",
        source_folder="tiny", source_file="tiny.gguf", settings={},
    )  # fmt: skip
    placement = Placement.objects.create(model=model, node=node)
    spec = lifecycle.launch_spec(model, placement)
    assert spec["container"] == {
        "image": "engine:1",
        "mounts": [{"source": "models", "target": "/models", "readOnly": True}],
        "shmSizeBytes": None,
    }
    args = spec["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert spec["executable"] == {"name": "llama.cpp", "version": None}
    running = {
        "state": "Ready",
        "fingerprint": llamacpp.execution_fingerprint(
            argv=args, executable_version="engine:1", env_names=[]
        ),
        "executable": {"version": "engine:1"},
    }
    assert not lifecycle.restart_pending(model, placement, running)
    model.image = "engine:2"
    assert lifecycle.restart_pending(model, placement, running)  # a new image: restart


def test_a_vllm_spec_asks_for_shared_memory_and_its_gpus() -> None:
    node = make_node("n1")
    model = ModelDefinition.objects.create(
        served_name="qwen", runtime="vllm", delivery="container", image=IMAGE,
        source_folder="Qwen", source_file="", settings={"gpu_memory_utilization": 0.8},
    )  # fmt: skip
    placement = Placement.objects.create(model=model, node=node, gpu_uuids=[GPU])
    spec = lifecycle.launch_spec(model, placement)
    assert spec["model"] == {"folder": "Qwen", "file": None}
    assert spec["container"]["shmSizeBytes"] == lifecycle.VLLM_SHM_BYTES
    assert spec["gpuUuids"] == [GPU]
    assert spec["args"][:3] == ["{model}", "--served-model-name", "qwen"]
    status = {"telemetry": {"gpus": [{"index": 0, "uuid": GPU, "memoryTotalBytes": 80 * 2**30,
                                      "memoryUsedBytes": 0}]}}  # fmt: skip
    estimate = lifecycle.vllm_estimate(model, placement, status)
    assert estimate["gpuBudgets"] == [int(0.8 * 80 * 2**30)]
    placement.gpu_uuids = []
    with pytest.raises(ServiceError, match="needs GPUs"):
        lifecycle.vllm_estimate(model, placement, status)


@pytest.mark.parametrize(
    ("features", "refused"),
    [
        (None, True),  # an agent that lists no runtime runs llama.cpp processes only
        (["runtime.llamacpp.process"], True),
        (["runtime.llamacpp.process", "runtime.llamacpp.container"], False),
    ],
)
def test_a_start_needs_a_node_that_offers_the_pair(
    features: list[str] | None, refused: bool
) -> None:
    node = make_node("n1", facts={"features": features} if features else {})
    model = ModelDefinition(runtime="llamacpp", delivery="container", image="engine:1")
    if refused:
        with pytest.raises(ServiceError) as caught:
            lifecycle.check_node_offers(model, node)
        assert (caught.value.status, caught.value.code) == (409, "runtime_not_offered")
        assert "DockerEnabled" in caught.value.message
    else:
        lifecycle.check_node_offers(model, node)
