"""Placement suggestions answer as the plain rule does, over a varied fleet (issue 19).

The ranking reads the nodes as rows (no ``Node`` instances, JSON decoded with orjson)
and makes one admission line per node. ``_reference`` below is the rule written
plainly, as the ranking was before issue 19: ``Node`` rows, lifecycle's
``starting_budgets`` per node, every GPU's ``admission.check``, the line with the most
free bytes. Both must give the same answer, field for field and message for message,
for every kind of node and model.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from typing import Any

import pytest
from django.utils import timezone

from core.errors import ServiceError
from models_registry import admission, lifecycle, suggest, vllm
from models_registry.models import ModelDefinition
from nodes import status as node_status
from nodes import status_cache
from nodes.models import Node
from tests.factories import make_node

pytestmark = pytest.mark.django_db

GIB = 2**30
OFFERS = ["runtime.llamacpp.process", "runtime.llamacpp.container", "runtime.vllm.container"]
LLAMA = [{"name": "llama.cpp", "version": "b4500", "verified": True}]
HEADER = {
    "tensorBytes": 4 * GIB,
    "blockCount": 32,
    "headCountKv": 8,
    "keyLength": 128,
    "valueLength": 128,
    "embeddingLength": 4096,
    "vocabSize": 32000,
    "fileSize": 5 * GIB,
}


def _reference(model: ModelDefinition, read_header: suggest.HeaderReader) -> dict[str, Any]:
    """The ranking's rule, plainly: what suggest.suggest_for must answer."""
    nodes = list(Node.objects.filter(approved=True, revoked=False).order_by("node_id"))
    statuses = node_status.read_many(nodes)

    def holds(status: Mapping[str, Any]) -> bool:
        weights = (status.get("telemetry") or {}).get("weights") or []
        return any(isinstance(w, dict) and w.get("folder") == model.source_folder for w in weights)

    vllm_model = model.runtime == ModelDefinition.Runtime.VLLM
    budget: int | None = None
    size: int | None = None
    if not vllm_model:
        for node in nodes:
            if not (
                node_status.is_serving(statuses[node.node_id]) and holds(statuses[node.node_id])
            ):
                continue
            try:
                header = read_header(model, node)
            except ServiceError:
                continue
            budget = int(lifecycle.estimate_for(model, 0, header)["budgetBytes"])
            size = int(header.get("fileSize") or 0) or None
            break
        else:
            estimate = model.estimate or {}
            found = model.memory_budget_bytes or estimate.get("budgetBytes")
            weights = (estimate.get("breakdown") or {}).get("weights")
            budget, size = (int(found) if found else None), (int(weights) if weights else None)
    settings = vllm.saved_settings(model.settings, model=model.served_name) if vllm_model else None
    candidates = []
    for node in nodes:
        status = statuses[node.node_id]
        serving = node_status.is_serving(status)
        starting = lifecycle.starting_budgets(status, skip="")
        reasons = []
        if model.delivery == ModelDefinition.Delivery.CONTAINER:
            try:
                lifecycle.check_node_offers(model, node)
                engine: bool | None = True
            except ServiceError:
                engine = False
        else:
            executables = (node.facts or {}).get("executables")
            engine = (
                any(e.get("name") == "llama.cpp" and e.get("verified", True) for e in executables)
                if executables
                else None
            )
        if not serving:
            reasons.append(f"not serving (state: {node_status.state_of(status)})")
        if node.draining:
            reasons.append("draining")
        if engine is False:
            reasons.append(
                f"does not offer {model.runtime} as a {model.delivery}"
                if model.delivery == ModelDefinition.Delivery.CONTAINER
                else "llama.cpp is not installed"
            )
        fits, gpus = False, []
        gpu_probe = admission.node_gpus(node, status)
        if settings is not None or budget is not None:
            lines = []
            for uuid, gpu in gpu_probe.items():
                share = (
                    vllm.memory_budget_bytes(settings, [int(gpu.get("memoryTotalBytes") or 0)])[0]
                    if settings is not None
                    else None
                )
                lines += admission.check(
                    node=node,
                    gpu_uuids=[uuid],
                    gpu_budgets=[] if share is None else [share],
                    budget=(budget or 0) if share is None else share,
                    status=status,
                    starting_budgets=starting,
                )
            if not lines and settings is None:
                lines = admission.check(
                    node=node, gpu_uuids=[], gpu_budgets=[], budget=budget or 0, status=status,
                    starting_budgets=starting,
                )  # fmt: skip
            if lines:
                # Every line ranked by its free bytes (left after the share for vLLM); max
                # keeps the first of the most.
                vllm_share = settings is not None
                best = max(lines, key=lambda ln: (ln.free or -1) - (ln.needs if vllm_share else 0))
                fits, gpus = best.fits, [best.uuid] if best.fits and best.uuid else []
                reasons.append(best.text())
            else:
                reasons.append("no GPU: vLLM needs GPUs")
        else:
            reasons.append("no estimate yet: no serving node holds the weights")
        disk: bool | None = True
        if not holds(status):
            disks = (status.get("telemetry") or {}).get("disks") or []
            free = disks[0].get("freeBytes") if disks and isinstance(disks[0], dict) else None
            if not isinstance(free, int) or size is None:
                disk = None
            else:
                disk = free >= size
                if not disk:
                    reasons.append(
                        f"models disk has {free / GIB:.1f} GiB free, the weights need "
                        f"{size / GIB:.1f} GiB"
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
                "suitable": bool(usable and fits and disk is not False),
                "fits": fits,
                "gpuUuids": gpus,
                "holdsWeights": holds(status),
                "engineInstalled": engine,
                "diskRoom": disk,
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


def _gpu(node_id: str, index: int, total: int | None, used: int | None) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{node_id}-{index}",
        "memoryTotalBytes": None if total is None else total * GIB,
        "memoryUsedBytes": None if used is None else used * GIB,
    }


def _status(
    node: Node,
    *,
    state: str = "Online",
    age: float = 0.0,
    gpus: list[dict[str, Any]] | None = None,
    available: int | None = 64,
    disk_free: int | None = 500,
    weights: bool = False,
    instances: list[dict[str, Any]] | None = None,
) -> None:
    telemetry: dict[str, Any] = {"memory": {"totalBytes": 128 * GIB}}
    if available is not None:
        telemetry["memory"]["availableBytes"] = available * GIB
    if gpus is not None:
        telemetry["gpus"] = gpus
    if disk_free is not None:
        telemetry["disks"] = [{"path": "/srv/models", "freeBytes": disk_free * GIB}]
    if weights:
        telemetry["weights"] = [{"folder": "f", "bytes": 1, "fetched": True}]
    status_cache.write(
        {
            "nodeId": node.node_id,
            "state": state,
            "reasons": [],
            "lastSeen": time.time() - age,
            "instances": {i["instanceId"]: i for i in instances or []},
            "telemetry": telemetry,
        }
    )


def _fleet(starting: ModelDefinition, shared: ModelDefinition) -> None:
    """Every kind of node the ranking tells apart."""

    def node(node_id: str, **kwargs: Any) -> Node:
        kwargs.setdefault("facts", {"executables": LLAMA, "features": OFFERS})
        return make_node(node_id, **kwargs)

    def gpus(node_id: str, *sizes: tuple[int | None, int | None]) -> list[dict[str, Any]]:
        return [_gpu(node_id, i, total, used) for i, (total, used) in enumerate(sizes)]

    def inst(i: str, model: Any, state: str, uuids: list[str] | None = None) -> dict[str, Any]:
        return {"instanceId": i, "modelId": model, "state": state, "gpuUuids": uuids or []}

    fit = node("fit")
    _status(fit, gpus=gpus("fit", (80, 40), (80, 10), (80, 10), (80, 70)))
    tight = node("tight")
    _status(tight, gpus=gpus("tight", (80, 70), (80, 79), (24, 20), (80, 80)), disk_free=1)
    odd = node("odd")  # no sizes, an over-full card, a card probed without its index
    odd_gpus = gpus("odd", (None, None), (80, 90), (40, 0))
    del odd_gpus[2]["index"]
    _status(odd, gpus=odd_gpus)
    busy = node("busy")  # Starting budgets: on one GPU, split over two, on the host
    _status(
        busy,
        gpus=gpus("busy", (80, 0), (80, 0), (80, 0)),
        instances=[
            inst("s1", starting.pk, "Starting", ["GPU-busy-0"]),
            inst("s2", str(starting.pk), "Starting", ["GPU-busy-1", "GPU-busy-2"]),
            inst("s3", shared.pk, "Starting"),
            inst("s4", 987654, "Starting", ["GPU-busy-2"]),  # a deleted model
            inst("r1", shared.pk, "Ready", ["GPU-busy-0"]),
            inst("r2", shared.pk, "Stopped"),
        ],
    )
    blank = node("blank-uuid")  # a probe with an empty UUID: never a GPU to pin
    _status(blank, gpus=[{**_gpu("blank-uuid", 0, 80, 0), "uuid": ""}])
    host = node("host")  # no GPU: host memory, with a Starting budget there
    _status(host, gpus=[], available=40, instances=[inst("h1", starting.pk, "Starting")])
    small = node("small", memory_reserve_bytes=10 * GIB)
    _status(small, available=35)
    unknown = node("unknown")
    _status(unknown, available=None, disk_free=None)
    _status(node("offline"), state="Offline", gpus=gpus("offline", (80, 0)))
    _status(node("stale"), age=60, gpus=gpus("stale", (80, 0)))
    _status(node("degraded"), state="Degraded", gpus=gpus("degraded", (80, 0)))
    # No status record: the enrollment facts' GPUs, a size past 64 bits among them.
    node(
        "silent",
        facts={
            "executables": LLAMA,
            "gpus": [_gpu("silent", 0, 80, 0), _gpu("silent", 1, 2**40, 0)],
        },
    )
    facts_only = node(
        "facts-gpus", facts={"executables": LLAMA, "gpus": [_gpu("facts-gpus", 0, 48, 0)]}
    )
    _status(facts_only)
    _status(node("draining", draining=True), gpus=gpus("draining", (80, 0)))
    held = node("held", maintenance_until=timezone.now() + dt.timedelta(hours=1))
    _status(held, gpus=gpus("held", (80, 0)))
    reserved = node("reserved", gpu_reserves={"GPU-reserved-1": 50 * GIB, "GPU-reserved-0": True})
    _status(reserved, gpus=gpus("reserved", (80, 0), (80, 0)))
    _status(node("no-engine", facts={}), gpus=gpus("no-engine", (80, 0)))
    unverified = node(
        "unverified", facts={"executables": [{"name": "llama.cpp", "verified": False}]}
    )
    _status(unverified, gpus=gpus("unverified", (80, 0)))
    _status(node("process-only", facts={"executables": LLAMA}), gpus=gpus("process-only", (80, 0)))
    # The weights' holders: one serving, one not.
    _status(node("holder"), gpus=gpus("holder", (80, 0)), weights=True)
    _status(node("holder-off"), state="Offline", weights=True)
    _status(node("pending", approved=False), gpus=gpus("pending", (80, 0)))
    _status(node("revoked", revoked=True), gpus=gpus("revoked", (80, 0)))


def _models() -> list[ModelDefinition]:
    def model(name: str, **fields: Any) -> ModelDefinition:
        values: dict[str, Any] = {"source_folder": "f", "source_file": "m.gguf", "settings": {}}
        return ModelDefinition.objects.create(served_name=name, **{**values, **fields})

    return [
        model(
            "manual", memory_budget_bytes=30 * GIB, estimate={"breakdown": {"weights": 20 * GIB}}
        ),
        model("estimated", estimate={"budgetBytes": 9 * GIB, "breakdown": {"weights": 2 * GIB}}),
        model("unknown-size", estimate={"budgetBytes": 9 * GIB}),
        model("no-estimate"),
        model("other-folder", source_folder="g", memory_budget_bytes=GIB),
        model(
            "vllm",
            runtime="vllm",
            delivery="container",
            image="vllm/vllm-openai:v0",
            source_file="",
            settings={"gpu_memory_utilization": 0.5},
        ),
        model(
            "container",
            delivery="container",
            image="ghcr.io/ggml-org/llama.cpp:server",
            memory_budget_bytes=8 * GIB,
        ),
    ]


def _header_from_holder(model: ModelDefinition, node: Node) -> dict[str, Any]:
    assert node.address and node.spki_pin  # what an agent call to the holder reads
    return HEADER


def _no_header(model: ModelDefinition, node: Node) -> dict[str, Any]:
    raise ServiceError(503, "node_unreachable", f"Node {node.node_id} does not answer.")


@pytest.mark.parametrize("read_header", [_header_from_holder, _no_header])
def test_the_ranking_answers_as_the_plain_rule_over_a_varied_fleet(
    status_redis: object, read_header: suggest.HeaderReader
) -> None:
    models = _models()
    _fleet(starting=models[1], shared=models[0])
    for model in models:
        expected = _reference(model, read_header)
        assert len(expected["suggestions"]) == 21  # not the pending and revoked nodes
        assert suggest.suggest_for(model, read_header=read_header) == expected, model.served_name


def test_the_fleet_covers_what_the_ranking_tells_apart(status_redis: object) -> None:
    """The fleet above reaches each branch: a check of the comparison, not of the code."""
    models = _models()
    _fleet(starting=models[1], shared=models[0])
    texts = {
        (s["node"], reason)
        for model in models
        for read_header in (_header_from_holder, _no_header)
        for s in _reference(model, read_header)["suggestions"]
        for reason in s["reasons"]
    }
    reasons = " | ".join(sorted(reason for _, reason in texts))
    for part in (
        "- fits",
        "- does not fit",
        "free memory unknown",
        "host memory: needs",
        "not serving (state: Offline)",
        "draining",
        "llama.cpp is not installed",
        "does not offer vllm as a container",
        "no GPU: vLLM needs GPUs",
        "no estimate yet",
        "models disk has 1.0 GiB free",
        "1099511627775.0 GiB free",  # the facts' GPU past 64 bits, read as an integer
    ):
        assert part in reasons, part
    ranked = suggest.suggest_for(models[0], read_header=_header_from_holder)["suggestions"]
    assert ranked[0]["node"] == "holder" and ranked[0]["holdsWeights"] is True
