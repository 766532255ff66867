"""The memory estimate of a definition that is not saved yet (the editor, as you type).

The rules are a start's (docs/decisions.md D66): the values are checked by the
services' own checks (models_registry.services), the GGUF header is read by the
agent of the node that would load it (lifecycle.read_header), and the breakdown
and one admission line per GPU come from lifecycle.estimate_for and
lifecycle.admission_lines. A vLLM draft reads no header: its budget is
gpu_memory_utilization of each placed GPU's total (lifecycle.vllm_estimate,
docs/decisions.md D89). Only the header is cached, per node, folder and file, so a
keystroke does not ask the agent again; nothing here writes to the database.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from core.errors import ServiceError
from models_registry import admission, lifecycle, services, suggest
from models_registry.models import ModelDefinition, Placement
from nodes import status as node_status
from nodes.agent_client import check_folder
from nodes.models import Node
from protocol.states import ACTIVE

# A header is the file's: it changes only when the file is replaced (a new download).
HEADER_TTL_SECONDS = 60.0
# A failed read (weights not there yet, node unreachable) is asked again soon, but not
# on every keystroke.
FAILURE_TTL_SECONDS = 5.0
MAX_CACHED = 256
FIELDS = (
    "modelId",
    "runtime",
    "delivery",
    "image",
    "sourceNode",
    "sourceFolder",
    "sourceFile",
    "settings",
    "memoryBudgetBytes",
    "placements",
)
# suggest.py ranks nodes by a GGUF estimate, which a vLLM model has none of.
VLLM_SUGGESTIONS_NOTE = (
    "No suggestions for a vLLM model: it takes gpu_memory_utilization of each GPU it is "
    "placed on, so tick a node's GPUs below and the estimate shows each one's share."
)

_cache: dict[tuple[str, str, str], tuple[float, dict[str, Any] | ServiceError]] = {}
_lock = threading.Lock()


def _invalid(field: str, message: str) -> ServiceError:
    return ServiceError(400, "invalid_request", f"{field}: {message}", details={"field": field})


def forget_headers() -> None:
    """Drop every cached header (tests; a new download can call it too)."""
    with _lock:
        _cache.clear()


def header(node: Node, folder: str, file: str) -> dict[str, Any]:
    """The GGUF header summary of ``folder/file`` on ``node``, cached (see the module)."""
    key = (node.node_id, folder, file)
    now = time.monotonic()
    with _lock:
        hit = _cache.get(key)
    if hit is not None and hit[0] > now:
        if isinstance(hit[1], ServiceError):
            raise hit[1]
        return hit[1]
    draft = ModelDefinition(source_folder=folder, source_file=file)
    try:
        found: dict[str, Any] | ServiceError = lifecycle.read_header(draft, node)
        ttl = HEADER_TTL_SECONDS
    except ServiceError as exc:
        found, ttl = exc, FAILURE_TTL_SECONDS
    with _lock:
        if len(_cache) >= MAX_CACHED:
            _cache.clear()  # a bounded cache; the next keystrokes fill it again
        _cache[key] = (now + ttl, found)
    if isinstance(found, ServiceError):
        raise found
    return found


def _model(value: Any) -> ModelDefinition | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid("modelId", "must be a model id (a whole number) or null")
    model = ModelDefinition.objects.filter(pk=value).first()
    if model is None:
        raise _invalid("modelId", f"model {value} does not exist")
    return model


def _placements(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The services' placement checks; an unknown node is this request's 400, not a 404."""
    try:
        return services._clean_placements({"placements": body.get("placements") or []}) or []
    except ServiceError as exc:
        if exc.status == 404:
            raise ServiceError(400, "invalid_request", f"placements: {exc.message}") from None
        raise


def _source_node(value: Any) -> Node | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _invalid("sourceNode", "must be a node id")
    node = Node.objects.filter(node_id=value, revoked=False).first()
    if node is None:
        raise _invalid("sourceNode", f"node '{value}' does not exist")
    return node


def _target(draft: ModelDefinition, placement: Placement) -> dict[str, Any]:
    """One node's estimate and admission lines, or why there is none (a start's checks,
    in a start's order: the node serves, offers the runtime, then the estimate)."""
    node = placement.node
    gpu_uuids = list(placement.gpu_uuids)
    status = node_status.read(node)
    vllm_draft = draft.runtime == ModelDefinition.Runtime.VLLM
    out: dict[str, Any] = {
        "node": node.node_id,
        "gpus": len(gpu_uuids),
        "runtime": draft.runtime,
        "lines": [],
    }
    if not node_status.is_serving(status):
        state = node_status.state_of(status)
        why = (
            "the model cannot start there now"
            if vllm_draft
            else "its GGUF header cannot be read now"
        )
        out["error"] = f"node {node.node_id} is {state}: {why}"
        return out
    try:
        lifecycle.check_node_offers(draft, node)
        if vllm_draft:
            estimate = lifecycle.vllm_estimate(draft, placement, status)
            # The start builds the argv after admission; a tensor parallel size that is
            # not the number of placed GPUs refuses it there, so it is said here too.
            lifecycle.launch_spec(draft, placement)
        else:
            found = header(node, draft.source_folder, draft.source_file)
            estimate = lifecycle.estimate_for(draft, len(gpu_uuids), found)
        lines = lifecycle.admission_lines(draft, placement, estimate, status)
    except ServiceError as exc:
        out["error"] = exc.message
        return out
    current = (status.get("instances") or {}).get(placement.instance_id) or {}
    out.update(
        {
            "breakdown": estimate["breakdown"],
            "budgetBytes": estimate["budgetBytes"],
            "budgetSource": estimate["budgetSource"],
            "architecture": estimate.get("architecture"),
            "fileType": estimate.get("fileType"),
            "lines": [line.to_json() for line in lines],
            "fits": all(line.fits for line in lines),
            # Its memory is in use already, so the lines count it once more than a
            # start would (a start of a running instance skips admission).
            "running": current.get("state") in ACTIVE,
        }
    )
    if vllm_draft:
        gpus = admission.node_gpus(node, status)
        out["gpuMemoryUtilization"] = draft.settings["gpu_memory_utilization"]
        out["gpuShares"] = [
            {
                "gpuUuid": uuid,
                "label": line.label,
                "totalBytes": gpus.get(uuid, {}).get("memoryTotalBytes"),
                "budgetBytes": share,
            }
            for uuid, line, share in zip(gpu_uuids, lines, estimate["gpuBudgets"], strict=True)
        ]
    return out


def _placement(
    saved: Placement | None, node: Node, gpu_uuids: list[str], gpu_budgets: list[int]
) -> Placement:
    """The placement as the form has it, unsaved. A saved replica keeps its row, so its
    instance id (what admission skips, what "running" reads) is the one the agent knows."""
    placement = Placement(node=node, gpu_uuids=gpu_uuids, gpu_budgets=gpu_budgets)
    if saved is not None:
        placement.pk, placement.model_id = saved.pk, saved.model_id
    return placement


def draft_estimate(body: Any) -> dict[str, Any]:
    """The breakdown and admission lines of an unsaved definition, per placement.

    ``body``: ``{modelId?, runtime?, delivery?, image?, sourceNode?, sourceFolder,
    sourceFile, settings, memoryBudgetBytes?, placements: [{node, gpuUuids?,
    gpuBudgets?}]}`` (``runtime`` llamacpp when absent; ``settings`` that runtime's).
    Without placements the estimate is for the host memory of ``sourceNode``. Bad input
    is a 400 naming the field; a node that cannot answer, or that the start would
    refuse (its runtime not offered; for vLLM, no GPUs placed), is that target's
    ``error``. A vLLM target carries ``gpuShares``: each placed GPU's total and the
    share vLLM takes of it.
    """
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_request", "The body must be a JSON object.")
    unknown = sorted(str(k) for k in set(body) - set(FIELDS))
    if unknown:
        raise _invalid(unknown[0], f"unknown field; known fields are {', '.join(FIELDS)}")
    model = _model(body.get("modelId"))
    runtime = services.clean_runtime(body.get("runtime", ModelDefinition.Runtime.LLAMACPP))
    delivery, image = services.clean_delivery(body, runtime, None)
    folder = check_folder(body.get("sourceFolder"), "sourceFolder")
    file = services.clean_model_file(runtime, body.get("sourceFile"))
    raw = body.get("settings", {})
    vllm_draft = runtime == ModelDefinition.Runtime.VLLM
    settings = services.clean_vllm_settings(raw) if vllm_draft else services.clean_settings(raw)
    budget = services._clean_budget(
        {"memory_budget_bytes": body["memoryBudgetBytes"]} if "memoryBudgetBytes" in body else {}
    ).get("memory_budget_bytes")
    placements = _placements(body)
    source = _source_node(body.get("sourceNode"))
    draft = ModelDefinition(
        served_name=model.served_name if model else "draft",
        runtime=runtime,
        delivery=delivery,
        image=image,
        source_folder=folder,
        source_file=file,
        settings=settings.to_dict(),
        memory_budget_bytes=budget,
    )
    saved = {p.node_id: p for p in model.placements.all()} if model else {}
    targets = [
        _target(
            draft,
            _placement(
                saved.get(item["node"].pk), item["node"], item["gpu_uuids"], item["gpu_budgets"]
            ),
        )
        for item in placements
    ]
    if not targets and source is not None:
        targets.append(_target(draft, _placement(None, source, [], [])))
    answer: dict[str, Any] = {
        "file": f"{folder}/{file}" if file else folder,
        "targets": targets,
    }
    if vllm_draft:
        answer.update(suggestions=[], suggestionsNote=VLLM_SUGGESTIONS_NOTE)
    else:
        ranked = suggest.suggest_for(
            draft, read_header=lambda m, node: header(node, m.source_folder, m.source_file)
        )
        answer["suggestions"] = ranked["suggestions"]
    return answer
