"""The llama.cpp admission estimate (docs/operator-guide.md, "Admission, placement and replicas").

llama.cpp cannot say how much memory a model will take before it takes it,
so the master estimates it from the GGUF header and the settings, on the safe
side, and admission uses the result as the model's budget:

    weights     = tensor data (all split parts) x min(1, gpuLayers / blockCount)
    kv          = attnLayers x ctxTotal x headCountKv x (keyLen x bytes(ctk) + valueLen x bytes(ctv))
    ssmState    = hybrid only: (blockCount - attnLayers) x parallel x (convState + ssmStateSize)
    compute     = max(256 MiB, ub x (embeddingLength + vocab) x 4 B x 1.2)
    cudaContext = 0.45 GiB per GPU
    budget      = 1.10 x (weights + kv + ssmState + compute) + cudaContext x GPUs
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GIB = 1024**3
MIB = 1024**2

# Bytes per element of each KV cache type (block formats: bytes per block / 32).
KV_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "iq4_nl": 18 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
}
SAFETY = 1.10
COMPUTE_FACTOR = 1.2
COMPUTE_FLOOR = 256 * MIB
CUDA_CONTEXT = 0.45 * GIB


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the estimate needs from a GGUF header."""

    tensor_bytes: int  # data of every tensor over all split parts
    block_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    embedding_length: int
    vocab_size: int
    full_attention_interval: int | None = None  # hybrid models: one attention layer per N
    ssm_conv_state_bytes: int = 0  # per layer and sequence
    ssm_state_bytes: int = 0


@dataclass(frozen=True)
class Estimate:
    """The breakdown the editor shows, in bytes."""

    weights: int
    kv: int
    ssm_state: int
    compute: int
    cuda_context: int
    budget: int

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["budgetGiB"] = round(self.budget / GIB, 2)
        return out


class EstimateError(ValueError):
    """A setting the estimate cannot use; the message names it."""


def estimate(
    shape: ModelShape,
    *,
    context_size: int,
    parallel: int,
    gpu_layers: int,
    micro_batch: int,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    gpus: int = 0,
) -> Estimate:
    """The memory budget of one llama.cpp instance, with its breakdown."""
    for name in ("cache_type_k", "cache_type_v"):
        kind = locals()[name]
        if kind not in KV_BYTES:
            raise EstimateError(f"{name}: {kind!r} is not a KV cache type the estimate knows")
    if shape.block_count <= 0:
        raise EstimateError("block_count: the GGUF header reports no layers")
    offload = min(1.0, max(0, gpu_layers) / shape.block_count)
    weights = shape.tensor_bytes * offload
    interval = shape.full_attention_interval or 1
    attn_layers = shape.block_count // interval if interval > 1 else shape.block_count
    ctx_total = context_size * parallel
    kv = (
        attn_layers
        * ctx_total
        * shape.head_count_kv
        * (shape.key_length * KV_BYTES[cache_type_k] + shape.value_length * KV_BYTES[cache_type_v])
    )
    ssm = 0.0
    if interval > 1:
        ssm = (
            (shape.block_count - attn_layers)
            * parallel
            * (shape.ssm_conv_state_bytes + shape.ssm_state_bytes)
        )
    compute = max(
        COMPUTE_FLOOR,
        micro_batch * (shape.embedding_length + shape.vocab_size) * 4 * COMPUTE_FACTOR,
    )
    cuda = CUDA_CONTEXT * gpus
    budget = SAFETY * (weights + kv + ssm + compute) + cuda
    return Estimate(
        weights=round(weights),
        kv=round(kv),
        ssm_state=round(ssm),
        compute=round(compute),
        cuda_context=round(cuda),
        budget=round(budget),
    )
