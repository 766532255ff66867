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
from nodes.listing import IN_MAX
from nodes.models import Node
from protocol.states import InstanceState


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
    node: Node,
    status: dict[str, Any],
    settings: vllm.VllmSettings,
    starting: dict[str | None, int],
) -> tuple[bool, list[str], str]:
    """vLLM on the node's roomiest GPU: its gpu_memory_utilization share of that card
    (lifecycle.vllm_estimate's rule, D89); (fits, GPUs, reason)."""
    gpus = admission.node_gpus(node, status)
    if not gpus:
        return False, [], "no GPU: vLLM needs GPUs"
    best = None
    for uuid, gpu in gpus.items():
        share = vllm.memory_budget_bytes(settings, [int(gpu.get("memoryTotalBytes") or 0)])[0]
        line = admission.check(
            node=node,
            gpu_uuids=[uuid],
            gpu_budgets=[share],
            budget=share,
            status=status,
            starting_budgets=starting,
        )[0]
        if best is None or (line.free or -1) - line.needs > (best.free or -1) - best.needs:
            best = line
    assert best is not None
    return best.fits, [best.uuid] if best.fits and best.uuid else [], best.text()


def _free(gpu: Mapping[str, Any], reserve: int, starting: int) -> int | None:
    """admission.check's free bytes of one GPU; None where it reads no sizes."""
    total, used = gpu.get("memoryTotalBytes"), gpu.get("memoryUsedBytes")
    if not isinstance(total, int) or not isinstance(used, int):
        return None
    return total - used - reserve - starting


def _budget_line(
    node: Node, status: dict[str, Any], budget: int, starting: dict[str | None, int]
) -> tuple[bool, list[str], str]:
    """A GGUF budget on the node's roomiest GPU, or in its host memory without GPUs.

    The roomiest GPU is picked first (the first of the most free bytes, as ranking every
    GPU's admission line did) and only its line is computed: one admission check per
    node, not one per GPU (issue 19).
    """
    gpus = admission.node_gpus(node, status)
    roomiest: str | None = None
    most = 0
    for uuid, gpu in gpus.items():
        # The comparison the ranking of every line made: `(line.free or -1)`.
        free = _free(gpu, node.gpu_reserve(uuid), starting.get(uuid, 0)) or -1
        if roomiest is None or free > most:
            roomiest, most = uuid, free
    line = admission.check(
        node=node,
        gpu_uuids=[] if roomiest is None else [roomiest],
        gpu_budgets=[],
        budget=budget,
        status=status,
        starting_budgets=starting,
    )[0]
    return line.fits, [line.uuid] if line.fits and line.uuid else [], line.text()


def _budget_rule(model: ModelDefinition) -> int:
    """lifecycle._budget_of's rule for a model already read."""
    estimated = int((model.estimate or {}).get("budgetBytes") or 0)
    if model.runtime == ModelDefinition.Runtime.VLLM:
        return estimated  # its GPU shares (D89); a manual budget does not apply
    return int(model.memory_budget_bytes or estimated)


def _starting_budgets(
    statuses: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str | None, int]]:
    """lifecycle.starting_budgets of every node, by node id, in one query.

    lifecycle.starting_budgets reads each Starting instance's model on its own, and this
    ranking asked it once per GPU of every node: a burst of starts across the fleet made
    that thousands of queries in one answer (issue 19). Here the models of every
    Starting instance are read once.
    """
    starting = {
        node_id: [
            inst
            for inst in (status.get("instances") or {}).values()
            if isinstance(inst, dict) and inst.get("state") == InstanceState.STARTING
        ]
        for node_id, status in statuses.items()
    }
    ids = {
        int(inst["modelId"])
        for insts in starting.values()
        for inst in insts
        if str(inst.get("modelId", "")).isdecimal() and len(str(inst["modelId"])) < 19
    }
    columns = ("id", "runtime", "estimate", "memory_budget_bytes")
    models = ModelDefinition.objects.only(*columns)
    if len(ids) > IN_MAX:  # every model: no IN of thousands of ids (SQLite refuses one)
        found = {m.pk: _budget_rule(m) for m in models if m.pk in ids}
    else:
        found = {m.pk: _budget_rule(m) for m in models.filter(pk__in=ids)} if ids else {}
    out: dict[str, dict[str | None, int]] = {}
    for node_id, insts in starting.items():
        budgets: dict[str | None, int] = {}
        for inst in insts:
            model_id = str(inst.get("modelId", ""))
            budget = (
                found.get(int(model_id), 0) if model_id.isdecimal() and len(model_id) < 19 else 0
            )
            uuids = inst.get("gpuUuids") or [None]
            for uuid in uuids:
                budgets[uuid] = budgets.get(uuid, 0) + budget // len(uuids)
        out[node_id] = budgets
    return out


def _models_disk_free(status: dict[str, Any]) -> int | None:
    disks = (status.get("telemetry") or {}).get("disks") or []
    if disks and isinstance(disks[0], dict) and isinstance(disks[0].get("freeBytes"), int):
        return disks[0]["freeBytes"]  # the agent lists the models root first
    return None


# What the ranking reads of every node (the rule of nodes.status, admission, the engine
# checks) and what an agent call to a holder needs; the certificate and time stamp
# columns are left out: converting four datetimes a row was a tenth of the answer at
# 1,000 nodes (issue 19). A field read here that is not listed costs a query per node.
_NODE_FIELDS = (
    "node_id",
    "address",
    "spki_pin",
    "pending_pin",
    "approved",
    "revoked",
    "draining",
    "maintenance_until",
    "facts",
    "memory_reserve_bytes",
    "gpu_reserves",
)

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
    """GET /api/models/{id}/placement-suggestions.

    The GGUF header is the editor's cached one (models_registry.drafts.header, 60 s per
    node and file): otherwise every answer asked a holder's agent for it again, a TLS
    connection and a round trip to a node inside the request (issue 19). A start reads
    the header afresh; a ranking may use one a minute old.
    """
    from models_registry import drafts  # drafts ranks the editor's forms through here

    return suggest_for(
        get_model(model_id),
        read_header=lambda model, node: drafts.header(node, model.source_folder, model.source_file),
    )


def suggest_for(
    model: ModelDefinition, read_header: HeaderReader = lifecycle.read_header
) -> dict[str, Any]:
    """The ranked suggestions for ``model``, saved or not (the editor's unsaved form:
    models_registry.drafts, which passes a ``read_header`` that caches per file)."""
    approved = Node.objects.filter(approved=True, revoked=False).only(*_NODE_FIELDS)
    nodes = list(approved.order_by("node_id"))
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
    starting = _starting_budgets(statuses)
    vllm_settings = (
        vllm.saved_settings(model.settings, model=model.served_name) if vllm_model else None
    )
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
        if vllm_settings is not None:
            fits, gpus, reason = _vllm_line(node, status, vllm_settings, starting[node.node_id])
            reasons.append(reason)
        elif budget is None:
            reasons.append("no estimate yet: no serving node holds the weights")
        else:
            fits, gpus, reason = _budget_line(node, status, budget, starting[node.node_id])
            reasons.append(reason)
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
