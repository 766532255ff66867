"""Admission rules: unified memory, per GPU, reserves, partial maps, starts in flight."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.weights._gguf import read_summary
from core.errors import ServiceError
from models_registry import admission, llamacpp
from nodes.models import Node
from protocol.tinygguf import write_tiny_gguf

GIB = 1024**3
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


def gpu_node(**kwargs: object) -> Node:
    return Node(
        node_id="win-1",
        gpu_reserves={GPU_A: int(2.5 * GIB)},
        facts={"gpus": [{"index": 0, "uuid": GPU_B}, {"index": 1, "uuid": GPU_A}]},
        **kwargs,
    )


def gpu_status(used_a: float, used_b: float = 1.0) -> dict:
    return {
        "telemetry": {
            "gpus": [
                {"index": 0, "uuid": GPU_B, "memoryTotalBytes": 8 * GIB,
                 "memoryUsedBytes": int(used_b * GIB)},
                {"index": 1, "uuid": GPU_A, "memoryTotalBytes": 16 * GIB,
                 "memoryUsedBytes": int(used_a * GIB)},
            ]
        }
    }  # fmt: skip


def test_refusal_names_the_gpu_and_its_numbers() -> None:
    node = gpu_node()
    # 16 GiB card, 7.3 GiB used, 2.5 GiB reserve: 6.2 GiB free after the reserve.
    lines = admission.check(
        node=node,
        gpu_uuids=[GPU_A],
        gpu_budgets=[],
        budget=int(8.9 * GIB),
        status=gpu_status(7.3),
        starting_budgets={},
    )
    assert [line.fits for line in lines] == [False]
    with pytest.raises(ServiceError) as caught:
        admission.refuse_unless_fits("qwen3-embedding", node, lines)
    error = caught.value
    assert error.status == 409 and error.code == "admission_refused"
    assert "GPU 1: needs 8.9 GiB, 6.2 GiB free after the 2.5 GiB reserve" in error.message
    assert error.details["lines"][0]["gpuUuid"] == GPU_A


def test_fits_when_the_card_has_room() -> None:
    lines = admission.check(
        node=gpu_node(),
        gpu_uuids=[GPU_A],
        gpu_budgets=[],
        budget=int(8.9 * GIB),
        status=gpu_status(2.0),
        starting_budgets={},
    )
    assert lines[0].fits and lines[0].text().endswith(" - fits")
    admission.refuse_unless_fits("m", gpu_node(), lines)  # does not raise


def test_a_partial_budget_map_is_refused() -> None:
    with pytest.raises(ServiceError) as caught:
        admission.check(
            node=gpu_node(),
            gpu_uuids=[GPU_A, GPU_B],
            gpu_budgets=[4 * GIB],
            budget=6 * GIB,
            status=gpu_status(1.0),
            starting_budgets={},
        )
    assert caught.value.status == 409
    assert "budgets for 1 of its 2 GPUs" in caught.value.message


def test_two_gpus_without_budgets_split_by_room_after_reserve() -> None:
    lines = admission.check(
        node=gpu_node(),
        gpu_uuids=[GPU_A, GPU_B],
        gpu_budgets=[],
        budget=int(20.5 * GIB),
        status=gpu_status(0.0, 0.0),
        starting_budgets={},
    )
    # Room after reserve: A 13.5 GiB (2.5 reserve), B 7 GiB (default 1 GiB): 27:14.
    assert [round(line.needs / GIB, 2) for line in lines] == [13.5, 7.0]
    assert all(line.fits for line in lines)


def test_each_gpu_checked_against_its_own_budget() -> None:
    lines = admission.check(
        node=gpu_node(),
        gpu_uuids=[GPU_A, GPU_B],
        gpu_budgets=[4 * GIB, 7 * GIB],
        budget=11 * GIB,
        status=gpu_status(1.0, 1.0),
        starting_budgets={},
    )
    assert [line.fits for line in lines] == [True, False]  # B: 8 - 1 used - 1 reserve = 6


def test_starts_in_flight_count_as_used() -> None:
    kwargs = {
        "node": gpu_node(),
        "gpu_uuids": [GPU_A],
        "gpu_budgets": [],
        "budget": 5 * GIB,
        "status": gpu_status(2.0),
    }
    assert admission.check(**kwargs, starting_budgets={})[0].fits  # type: ignore[arg-type]
    crowded = admission.check(**kwargs, starting_budgets={GPU_A: 7 * GIB})  # type: ignore[arg-type]
    assert not crowded[0].fits


def test_unified_memory_uses_available_minus_reserve() -> None:
    node = Node(node_id="mac-1", memory_reserve_bytes=4 * GIB)
    status = {"telemetry": {"memory": {"availableBytes": 10 * GIB}}}
    line = admission.check(
        node=node, gpu_uuids=[], gpu_budgets=[], budget=7 * GIB, status=status,
        starting_budgets={},
    )[0]  # fmt: skip
    assert not line.fits
    assert line.text() == (
        "host memory: needs 7.0 GiB, 6.0 GiB free after the 4.0 GiB reserve - does not fit"
    )
    no_report = admission.check(
        node=node, gpu_uuids=[], gpu_budgets=[], budget=GIB, status=None, starting_budgets={}
    )[0]
    assert not no_report.fits and "unknown" in no_report.text()


def test_estimate_from_a_real_header(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    summary = read_summary(path)
    settings = llamacpp.LlamaCppSettings.from_dict({"context_size": 512, "gpu_layers": 0})
    cpu = admission.compute_estimate(summary, settings, gpus=0)
    gpu = admission.compute_estimate(summary, settings, gpus=1)
    # On a CPU node every weight is in host memory whatever -ngl says; with -ngl 0 on a
    # GPU none are offloaded, and the GPU pays its CUDA context.
    assert cpu.weights == summary["tensorBytes"] and gpu.weights == 0
    assert gpu.cuda_context == round(0.45 * GIB)


def test_hybrid_header_adds_ssm_state() -> None:
    summary = {
        "tensorBytes": GIB,
        "blockCount": 48,
        "headCountKv": 2,
        "keyLength": 256,
        "valueLength": 256,
        "embeddingLength": 2048,
        "vocabSize": 151936,
        "fullAttentionInterval": 4,
        "ssmConvKernel": 4,
        "ssmInnerSize": 4096,
        "ssmStateSize": 128,
        "ssmGroupCount": 16,
    }
    shape = admission.shape_from_summary(summary)
    assert shape.ssm_conv_state_bytes == 3 * (4096 + 2 * 16 * 128) * 4
    assert shape.ssm_state_bytes == 128 * 4096 * 4
    settings = llamacpp.LlamaCppSettings.from_dict({"context_size": 4096, "parallel": 2})
    result = admission.compute_estimate(summary, settings, gpus=1)
    assert result.ssm_state == 36 * 2 * (shape.ssm_conv_state_bytes + shape.ssm_state_bytes)
    # Only the 12 attention layers hold a KV cache.
    assert result.kv == 12 * 8192 * 2 * (256 * 2 + 256 * 2)


def test_a_header_without_layers_is_a_clear_error() -> None:
    with pytest.raises(Exception, match="blockCount"):
        admission.shape_from_summary({"tensorBytes": 1})
