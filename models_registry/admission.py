"""Admission: does a model's memory budget fit where it is placed, right now?

Two kinds of node (docs/operator-guide.md, "Admission, placement and replicas"):

* CPU and unified-memory nodes (no GPU pinned by the placement): the budget
  must fit the host's available memory minus the node's reserve.
* Discrete GPUs (the placement pins GPU UUIDs): each GPU's share of the budget
  must fit that GPU's free memory (total minus used, from the agent's GPU
  probe, never from CUDA) minus that GPU's reserve. A multi-GPU placement
  either names a budget for every GPU or none (then the budget is split by
  each card's total minus its reserve, as the argv's --tensor-split is); a map
  naming only some GPUs is refused.

Instances still Starting on the node have not allocated yet, so their
budgets are counted as used: two starts queued back to back must not both be
admitted into the same free memory. ``force`` skips these memory checks and
nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from core.errors import ServiceError
from models_registry import estimate as est
from models_registry import llamacpp
from nodes.models import Node

GIB = 1024**3


class HasFacts(Protocol):
    """What :func:`node_gpus` reads of a node (a ``Node``, or suggest's lighter row)."""

    @property
    def facts(self) -> Any: ...


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


@dataclass(frozen=True)
class Line:
    """One admission verdict: a GPU, or the host memory of a node."""

    label: str  # "GPU 1" or "host memory"
    uuid: str | None
    needs: int
    free: int | None  # free after the reserve; None when the node reported nothing
    reserve: int
    fits: bool

    def text(self) -> str:
        if self.free is None:
            return f"{self.label}: needs {gib(self.needs)}, free memory unknown (no report yet)"
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"{self.label}: needs {gib(self.needs)}, {gib(max(0, self.free))} free after the "
            f"{gib(self.reserve)} reserve - {verdict}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "gpuUuid": self.uuid,
            "needsBytes": self.needs,
            "freeAfterReserveBytes": self.free,
            "reserveBytes": self.reserve,
            "fits": self.fits,
            "text": self.text(),
        }


def shape_from_summary(summary: dict[str, Any]) -> est.ModelShape:
    """The estimate's inputs from the agent's GGUF header summary (docs/agent-api.md, "GET /agent/v1/folders/{folder}/gguf")."""

    def integer(key: str, default: int | None = None) -> int:
        value = summary.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            if default is not None:
                return default
            raise est.EstimateError(f"the GGUF header has no usable {key}")
        return value

    interval = summary.get("fullAttentionInterval")
    conv_bytes = ssm_bytes = 0
    if isinstance(interval, int) and interval > 1:
        inner = integer("ssmInnerSize", 0)
        state = integer("ssmStateSize", 0)
        groups = integer("ssmGroupCount", 0)
        kernel = integer("ssmConvKernel", 0)
        # f32 recurrent state, as llama.cpp keeps it: the conv window over the
        # inner channels plus B and C, and the SSM state itself.
        conv_bytes = max(0, kernel - 1) * (inner + 2 * groups * state) * 4
        ssm_bytes = state * inner * 4
    return est.ModelShape(
        tensor_bytes=integer("tensorBytesAllParts", integer("tensorBytes")),
        block_count=integer("blockCount"),
        head_count_kv=integer("headCountKv"),
        key_length=integer("keyLength"),
        value_length=integer("valueLength"),
        embedding_length=integer("embeddingLength"),
        vocab_size=integer("vocabSize"),
        full_attention_interval=interval if isinstance(interval, int) else None,
        ssm_conv_state_bytes=conv_bytes,
        ssm_state_bytes=ssm_bytes,
    )


def compute_estimate(
    summary: dict[str, Any], settings: llamacpp.LlamaCppSettings, *, gpus: int
) -> est.Estimate:
    """The budget of one instance with these settings on ``gpus`` GPUs (0: CPU/unified)."""
    shape = shape_from_summary(summary)
    micro = settings.micro_batch() or settings.ubatch_size or min(settings.context_size, 512)
    return est.estimate(
        shape,
        context_size=settings.context_size,
        parallel=settings.parallel,
        # Without a GPU every weight lives in host memory whatever -ngl says.
        gpu_layers=settings.gpu_layers if gpus else shape.block_count,
        micro_batch=micro,
        cache_type_k=settings.cache_type_k,
        cache_type_v=settings.cache_type_v,
        gpus=gpus,
    )


def node_gpus(node: HasFacts, status: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The node's GPUs by UUID: the latest heartbeat's probe, else the enrollment facts."""
    telemetry = (status or {}).get("telemetry") or {}
    gpus = telemetry.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        gpus = (node.facts or {}).get("gpus") or []
    return {g["uuid"]: g for g in gpus if isinstance(g, dict) and isinstance(g.get("uuid"), str)}


def split_budget(
    budget: int, uuids: list[str], gpus: dict[str, dict[str, Any]], node: Node
) -> list[int]:
    """The default per-GPU shares: proportional to each card's total minus its reserve."""
    weights = []
    for uuid in uuids:
        total = int(gpus.get(uuid, {}).get("memoryTotalBytes") or 0)
        weights.append(max(1, total - node.gpu_reserve(uuid)))
    whole = sum(weights)
    return [budget * w // whole for w in weights]


def gpu_free(gpu: Mapping[str, Any] | None, reserve: int, starting: int) -> int | None:
    """One GPU's free bytes after its reserve and the budgets Starting on it; None where
    the probe gave no sizes."""
    total, used = (gpu or {}).get("memoryTotalBytes"), (gpu or {}).get("memoryUsedBytes")
    if not isinstance(total, int) or not isinstance(used, int):
        return None
    return total - used - reserve - starting


def gpu_line(
    uuid: str, gpu: Mapping[str, Any] | None, share: int, reserve: int, starting: int
) -> Line:
    """The admission line of ``share`` bytes on one GPU (``gpu``: its probe, if any)."""
    label = f"GPU {gpu.get('index')}" if gpu and gpu.get("index") is not None else uuid
    free = gpu_free(gpu, reserve, starting)
    return Line(label, uuid, share, free, reserve, free is not None and share <= free)


def host_line(status: Mapping[str, Any] | None, budget: int, reserve: int, starting: int) -> Line:
    """The admission line of ``budget`` bytes in the node's host memory."""
    memory = ((status or {}).get("telemetry") or {}).get("memory") or {}
    available = memory.get("availableBytes")
    if not isinstance(available, int):
        return Line("host memory", None, budget, None, reserve, False)
    free = available - reserve - starting
    return Line("host memory", None, budget, free, reserve, budget <= free)


def check(
    *,
    node: Node,
    gpu_uuids: list[str],
    gpu_budgets: list[int],
    budget: int,
    status: Mapping[str, Any] | None,
    starting_budgets: dict[str | None, int],
) -> list[Line]:
    """Every admission line of one placement; a partial budget map is refused outright.

    ``starting_budgets`` maps a GPU UUID (None: host memory) to the budgets of
    other instances on this node that are still Starting.
    """
    if not gpu_uuids:
        return [host_line(status, budget, node.memory_reserve_bytes, starting_budgets.get(None, 0))]
    if gpu_budgets and len(gpu_budgets) != len(gpu_uuids):
        raise ServiceError(
            409,
            "admission_refused",
            f"The placement on {node.node_id} names budgets for {len(gpu_budgets)} of its "
            f"{len(gpu_uuids)} GPUs; name a budget for every GPU of the start, or none.",
        )
    gpus = node_gpus(node, status)
    shares = gpu_budgets or split_budget(budget, gpu_uuids, gpus, node)
    return [
        gpu_line(uuid, gpus.get(uuid), share, node.gpu_reserve(uuid), starting_budgets.get(uuid, 0))
        for uuid, share in zip(gpu_uuids, shares, strict=True)
    ]


def refuse_unless_fits(served_name: str, node: Node, lines: list[Line]) -> None:
    """409 admission_refused naming the exact numbers of every line that does not fit."""
    bad = [line for line in lines if not line.fits]
    if not bad:
        return
    raise ServiceError(
        409,
        "admission_refused",
        f"Model '{served_name}' does not fit on node {node.node_id}: "
        + "; ".join(line.text() for line in bad)
        + ". Lower the context size or parallel slots, free memory, lower the node's reserve, "
        "or start with force.",
        details={"node": node.node_id, "lines": [line.to_json() for line in lines]},
    )
