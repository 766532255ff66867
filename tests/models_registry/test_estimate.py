"""The admission estimate, against the worked example of docs/operator-guide.md, "Admission, placement and replicas"."""

from __future__ import annotations

import pytest

from models_registry.estimate import GIB, EstimateError, ModelShape, estimate

# Qwen3-Embedding-4B Q8_0: 36 layers, 8 KV heads, head dim 128, n_embd 2560, vocab 151 665.
QWEN3_EMBEDDING_4B_Q8 = ModelShape(
    tensor_bytes=round(3.99 * GIB),
    block_count=36,
    head_count_kv=8,
    key_length=128,
    value_length=128,
    embedding_length=2560,
    vocab_size=151_665,
)


def test_worked_example() -> None:
    result = estimate(
        QWEN3_EMBEDDING_4B_Q8,
        context_size=8192,
        parallel=2,
        gpu_layers=999,
        micro_batch=2048,
        gpus=1,
    )
    assert result.weights / GIB == pytest.approx(3.99, abs=0.005)
    assert result.kv / GIB == pytest.approx(2.25, abs=0.005)
    assert result.compute / GIB == pytest.approx(1.41, abs=0.005)
    assert result.cuda_context / GIB == pytest.approx(0.45)
    assert result.budget / GIB == pytest.approx(8.9, abs=0.05)


def test_the_model_cards_micro_batch_would_not_fit() -> None:
    # At the model card's -ub 8192 the same formula gives 13.5 GiB (docs/operator-guide.md, "Admission, placement and replicas").
    result = estimate(
        QWEN3_EMBEDDING_4B_Q8,
        context_size=8192,
        parallel=2,
        gpu_layers=999,
        micro_batch=8192,
        gpus=1,
    )
    assert result.budget / GIB == pytest.approx(13.5, abs=0.05)


def test_partial_offload_and_kv_types() -> None:
    half = estimate(
        QWEN3_EMBEDDING_4B_Q8, context_size=8192, parallel=2, gpu_layers=18, micro_batch=2048
    )
    assert half.weights / GIB == pytest.approx(3.99 / 2, abs=0.005)
    q8 = estimate(
        QWEN3_EMBEDDING_4B_Q8,
        context_size=8192,
        parallel=2,
        gpu_layers=999,
        micro_batch=2048,
        cache_type_k="q8_0",
        cache_type_v="q8_0",
    )
    assert q8.kv / GIB == pytest.approx(2.25 * 34 / 64, abs=0.005)
    with pytest.raises(EstimateError, match="cache_type_k"):
        estimate(
            QWEN3_EMBEDDING_4B_Q8,
            context_size=1,
            parallel=1,
            gpu_layers=1,
            micro_batch=1,
            cache_type_k="q9",
        )


def test_hybrid_model_counts_attention_layers_and_ssm_state() -> None:
    shape = ModelShape(
        tensor_bytes=GIB,
        block_count=48,
        head_count_kv=4,
        key_length=128,
        value_length=128,
        embedding_length=2048,
        vocab_size=32_000,
        full_attention_interval=4,
        ssm_conv_state_bytes=1 * 1024 * 1024,
        ssm_state_bytes=3 * 1024 * 1024,
    )
    result = estimate(shape, context_size=4096, parallel=2, gpu_layers=999, micro_batch=512)
    assert result.kv == 12 * 8192 * 4 * (128 * 2 + 128 * 2)
    assert result.ssm_state == (48 - 12) * 2 * 4 * 1024 * 1024
    assert result.compute == 256 * 1024 * 1024  # the floor
