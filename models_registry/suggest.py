"""Placement suggestions: where a model would best run, and why the others would not.

Ranked, best first, on what an operator weighs (docs/operator-guide.md, "Admission, placement
and replicas": engine presence in placement, disk checks): the budget fits the
node's free memory now (on a GPU node, the single GPU with the most room);
the node has the engine installed (a node that reports no executables at all
is not excluded, only ranked lower: older agents report none); it already
holds the weights (no download, no disk needed); otherwise its models disk
has room for them; and it runs the fewest instances. Nothing here changes
the placement: the operator picks, the API call stays explicit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from core.errors import ServiceError
from models_registry import admission, lifecycle, vllm
from models_registry.models import ModelDefinition
from models_registry.services import get_model
from nodes import status as node_status
from nodes.models import Node


def _holds(status: Mapping[str, Any], folder: str) -> bool:
    weights = (status.get("telemetry") or {}).get("weights") or []
    return any(isinstance(w, dict) and w.get("folder") == folder for w in weights)


def _engine(node: Node, model: ModelDefinition) -> bool | None:
    """Whether the node can run the model's engine: for a container the runtime it
    offers (lifecycle.check_node_offers' rule), for a process its llama.cpp build."""
    if model.delivery == ModelDefinition.Delivery.CONTAINER:
        try:
            lifecycle.check_node_offers(model, node)
        except ServiceError:
            return False
        return True
    executables = (node.facts or {}).get("executables")
    if not executables:
        return None  # unknown: an agent that does not report its engines
    return any(e.get("name") == "llama.cpp" and e.get("verified", True) for e in executables)


def _vllm_line(
    model: ModelDefinition, node: Node, status: dict[str, Any]
) -> tuple[bool, list[str], str]:
    """vLLM on the node's roomiest GPU: its gpu_memory_utilization share of that card
    (lifecycle.vllm_estimate's rule, D89); (fits, GPUs, reason)."""
    gpus = admission.node_gpus(node, status)
    if not gpus:
        return False, [], "no GPU: vLLM needs GPUs"
    settings = vllm.saved_settings(model.settings, model=model.served_name)
    best = None
    for uuid, gpu in gpus.items():
        share = vllm.memory_budget_bytes(settings, [int(gpu.get("memoryTotalBytes") or 0)])[0]
        line = admission.check(
            node=node,
            gpu_uuids=[uuid],
            gpu_budgets=[share],
            budget=share,
            status=status,
            starting_budgets=lifecycle.starting_budgets(status, skip=""),
        )[0]
        if best is None or (line.free or -1) - line.needs > (best.free or -1) - best.needs:
            best = line
    assert best is not None
    return best.fits, [best.uuid] if best.fits and best.uuid else [], best.text()


def _models_disk_free(status: dict[str, Any]) -> int | None:
    disks = (status.get("telemetry") or {}).get("disks") or []
    if disks and isinstance(disks[0], dict) and isinstance(disks[0].get("freeBytes"), int):
        return disks[0]["freeBytes"]  # the agent lists the models root first
    return None


HeaderReader = Callable[[ModelDefinition, Node], dict[str, Any]]


def _budget_and_size(
    model: ModelDefinition, holders: list[Node], read_header: HeaderReader
) -> tuple[int | None, int | None]:
    """The budget (from a node holding the file, else the last estimate) and the file size."""
    estimate = model.estimate or {}
    for node in holders:
        try:
            header = read_header(model, node)
        except ServiceError:
            continue
        # Estimated for the host memory of one node; a GPU placement adds its CUDA context.
        computed = lifecycle.estimate_for(model, 0, header)
        return int(computed["budgetBytes"]), int(header.get("fileSize") or 0) or None
    budget = model.memory_budget_bytes or estimate.get("budgetBytes")
    size = (estimate.get("breakdown") or {}).get("weights")
    return (int(budget) if budget else None), (int(size) if size else None)


def suggest_placements(model_id: int) -> dict[str, Any]:
    """GET /api/models/{id}/placement-suggestions."""
    return suggest_for(get_model(model_id))


def suggest_for(
    model: ModelDefinition, read_header: HeaderReader = lifecycle.read_header
) -> dict[str, Any]:
    """The ranked suggestions for ``model``, saved or not (the editor's unsaved form:
    models_registry.drafts, which passes a ``read_header`` that caches per file)."""
    nodes = list(Node.objects.filter(approved=True, revoked=False).order_by("node_id"))
    statuses = node_status.read_many(nodes)
    holders = [
        n
        for n in nodes
        if node_status.is_serving(statuses[n.node_id])
        and _holds(statuses[n.node_id], model.source_folder)
    ]
    vllm_model = model.runtime == ModelDefinition.Runtime.VLLM
    # vLLM's budget is a share of each card, not a file's estimate (D89).
    budget, size = (None, None) if vllm_model else _budget_and_size(model, holders, read_header)
    candidates = []
    for node in nodes:
        status: dict[str, Any] = dict(statuses[node.node_id])
        state = node_status.state_of(statuses[node.node_id])
        serving = node_status.is_serving(statuses[node.node_id])
        reasons: list[str] = []
        holds = _holds(status, model.source_folder)
        engine = _engine(node, model)
        gpus: list[str] = []
        fits = False
        if not serving:
            reasons.append(f"not serving (state: {state})")
        if node.draining:
            reasons.append("draining")
        if engine is False:
            reasons.append(
                f"does not offer {model.runtime} as a {model.delivery}"
                if model.delivery == ModelDefinition.Delivery.CONTAINER
                else "llama.cpp is not installed"
            )
        if vllm_model:
            fits, gpus, reason = _vllm_line(model, node, status)
            reasons.append(reason)
        elif budget is None:
            reasons.append("no estimate yet: no serving node holds the weights")
        else:
            free_gpus = admission.node_gpus(node, status)
            if free_gpus:
                best = None
                for uuid in free_gpus:
                    line = admission.check(
                        node=node,
                        gpu_uuids=[uuid],
                        gpu_budgets=[],
                        budget=budget,
                        status=status,
                        starting_budgets=lifecycle.starting_budgets(status, skip=""),
                    )[0]
                    if best is None or (line.free or -1) > (best.free or -1):
                        best = line
                assert best is not None
                fits = best.fits
                if fits and best.uuid:
                    gpus = [best.uuid]
                reasons.append(best.text())
            else:
                line = admission.check(
                    node=node,
                    gpu_uuids=[],
                    gpu_budgets=[],
                    budget=budget,
                    status=status,
                    starting_budgets=lifecycle.starting_budgets(status, skip=""),
                )[0]
                fits = line.fits
                reasons.append(line.text())
        disk_ok: bool | None = True
        if not holds:
            free = _models_disk_free(status)
            if free is None or size is None:
                disk_ok = None
            else:
                disk_ok = free >= size
                if not disk_ok:
                    reasons.append(
                        f"models disk has {free / admission.GIB:.1f} GiB free, the weights need "
                        f"{size / admission.GIB:.1f} GiB"
                    )
        load = sum(
            1
            for inst in (status.get("instances") or {}).values()
            if inst.get("state") in lifecycle.ACTIVE
        )
        usable = serving and not node.draining and engine is not False
        candidates.append(
            {
                "node": node.node_id,
                "suitable": bool(usable and fits and disk_ok is not False),
                "fits": fits,
                "gpuUuids": gpus,
                "holdsWeights": holds,
                "engineInstalled": engine,
                "diskRoom": disk_ok,
                "instances": load,
                "reasons": reasons,
            }
        )
    candidates.sort(
        key=lambda c: (
            not c["suitable"],
            not c["fits"],
            c["engineInstalled"] is not True,
            not c["holdsWeights"],
            c["instances"],
            c["node"],
        )
    )
    return {
        "modelId": model.pk,
        "servedName": model.served_name,
        "budgetBytes": budget,
        "suggestions": candidates,
    }
