"""Model definitions: create, place, build launch specs, start and stop.

The answers follow docs/operator-guide.md ("Admin API answers for model
commands"): 404 unknown model, 409 for conflicts the operator must resolve
(unplaced, node not registered, revoked or draining), 503 when the node is not
serving or cannot be reached, 422 when the agent refuses the spec.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.db import transaction

from core.errors import ServiceError
from models_registry import llamacpp, vllm
from models_registry.models import ModelDefinition, Placement, Route
from nodes import status as node_status
from nodes.events import ModelSummary
from nodes.models import Node
from nodes.status_cache import NodeStatus
from protocol.engine_flags import DELIVERIES
from protocol.images import ImageRefused, parse_image
from protocol.names import FOLDER_MAX, path_name_problem
from protocol.states import InstanceState

log = logging.getLogger("mirbad.models")
T = TypeVar("T")

SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


def _invalid(field: str, message: str) -> ServiceError:
    return ServiceError(400, "invalid_request", f"{field}: {message}", details={"field": field})


def clean_served_name(field: str, value: Any) -> str:
    """``value`` when it is a valid served name (routes' names follow it too), else 400
    naming ``field``."""
    if not isinstance(value, str) or not SERVED_NAME.fullmatch(value):
        raise _invalid(
            field,
            "use 1-200 letters, digits and . _ : / @ + - (no spaces or commas), "
            "starting with a letter or digit",
        )
    return value


def routes_naming(served_name: str) -> list[str]:
    """The routes that list ``served_name`` among their targets (few rows: read in full,
    as SQLite cannot search inside a JSON list)."""
    return [r.name for r in Route.objects.all() if served_name in r.targets]


def _refuse_if_routed(model: ModelDefinition, what: str) -> None:
    """A model that routes name is neither deleted nor renamed: the route would point at
    nothing (docs/operator-guide.md, "Routes: aliases and fallbacks")."""
    routes = routes_naming(model.served_name)
    if routes:
        names = ", ".join(f"'{r}'" for r in routes)
        raise ServiceError(
            409,
            "model_in_route",
            f"Model '{model.served_name}' is a target of the route(s) {names}: remove it from "
            f"them (or delete them) before you {what} it.",
        )


def validate_definition(data: dict[str, Any], *, instance: ModelDefinition | None = None) -> dict:
    """Check a definition's fields; returns the cleaned values or raises 400 naming the field."""
    cleaned: dict[str, Any] = {}
    served = clean_served_name(
        "served_name", data.get("served_name", instance.served_name if instance else None)
    )
    clash = ModelDefinition.objects.filter(served_name=served)
    if instance is not None:
        clash = clash.exclude(pk=instance.pk)
    if clash.exists():
        raise ServiceError(
            409,
            "served_name_taken",
            f"served_name: '{served}' is already used by another model (stopped ones count too).",
        )
    if Route.objects.filter(name=served).exists():
        # A client's ``model`` must mean one thing (models_registry.routes).
        raise ServiceError(
            409,
            "served_name_taken",
            f"served_name: '{served}' is the name of a route; choose another name.",
        )
    if instance is not None and served != instance.served_name:
        _refuse_if_routed(instance, "rename")
    cleaned["served_name"] = served
    runtime = clean_runtime(data.get("runtime", instance.runtime if instance else "llamacpp"))
    cleaned["runtime"] = runtime
    cleaned["delivery"], cleaned["image"] = clean_delivery(data, runtime, instance)
    folder = data.get("source_folder", instance.source_folder if instance else None)
    problem = path_name_problem(folder, FOLDER_MAX)  # the agent's own rule, not a copy
    if problem is not None:
        shown = f"{folder!r} " if isinstance(folder, str) and len(folder) <= 80 else ""
        raise _invalid(
            "source_folder", f"use 1-200 letters, digits, '.', '_' or '-' ({shown}{problem})"
        )
    cleaned["source_folder"] = folder
    cleaned["source_file"] = clean_model_file(
        runtime, data.get("source_file", instance.source_file if instance else None)
    )
    raw_settings = data.get("settings", instance.settings if instance else {})
    cleaned["settings"] = (
        clean_vllm_settings(raw_settings) if runtime == "vllm" else clean_settings(raw_settings)
    ).to_dict()
    if "auto_start" in data:
        if not isinstance(data["auto_start"], bool):
            raise _invalid("auto_start", "must be true or false")
        cleaned["auto_start"] = data["auto_start"]
    cleaned |= clean_serving(data)
    return cleaned


# The serving policy's fields (docs/operator-guide.md, "Serving"): the services' name, the
# API's name (the one refusals use), and the range of a whole number (None: a bool).
# Idle unload runs every few seconds (models_registry.ondemand), so a shorter idle time
# would only be rounded up; a load or wait past an hour is a misconfiguration.
SERVING_FIELDS: dict[str, tuple[str, tuple[int, int] | None, str | None]] = {
    # name: (API name, (low, high) or None for a bool, what null means or None: no null)
    "load_on_demand": ("loadOnDemand", None, None),
    "pinned": ("pinned", None, None),
    "idle_unload_seconds": ("idleUnloadSeconds", (10, 30 * 24 * 3600), "never unload"),
    "load_timeout_seconds": ("loadTimeoutSeconds", (1, 3600), None),
    "queue_max_length": ("queueMaxLength", (0, 100_000), "MIRBAD_QUEUE_MAX"),
    "queue_timeout_seconds": ("queueTimeoutSeconds", (1, 3600), "MIRBAD_QUEUE_TIMEOUT"),
}


def clean_serving(data: dict[str, Any]) -> dict[str, Any]:
    """The serving policy's fields present in ``data``, checked; 400 naming the field."""
    cleaned: dict[str, Any] = {}
    for name, (api_name, bounds, null_means) in SERVING_FIELDS.items():
        if name not in data:
            continue
        value = data[name]
        if bounds is None:
            if not isinstance(value, bool):
                raise _invalid(api_name, "must be true or false")
        elif value is not None or null_means is None:
            low, high = bounds
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                empty = f", or null ({null_means})" if null_means else ""
                raise _invalid(
                    api_name,
                    f"must be a whole number of {_unit(name)} from {low} to {high}{empty}",
                )
        cleaned[name] = value
    return cleaned


def _unit(name: str) -> str:
    return "seconds" if name.endswith("_seconds") else "requests"


RUNTIMES = ("llamacpp", "vllm")


def clean_runtime(runtime: Any) -> str:
    """One of RUNTIMES, else 400 naming runtime."""
    if runtime not in RUNTIMES:
        raise _invalid("runtime", f"use one of {', '.join(RUNTIMES)}")
    return str(runtime)


def clean_model_file(runtime: str, file: Any) -> str:
    """The model's file: a .gguf for llama.cpp; for vLLM empty (the whole Hugging Face
    folder is the model) or a file of the folder."""
    if runtime == "vllm" and file in (None, ""):
        return ""
    return clean_source_file(file)


def clean_delivery(
    data: dict[str, Any], runtime: str, instance: ModelDefinition | None
) -> tuple[str, str]:
    """(delivery, image): vLLM only in a container; a container needs an image reference."""
    default = "container" if runtime == "vllm" else "process"
    delivery = data.get("delivery", instance.delivery if instance else default)
    if delivery not in DELIVERIES:
        raise _invalid("delivery", f"use one of {', '.join(DELIVERIES)}")
    if runtime == "vllm" and delivery != "container":
        raise _invalid("delivery", "vLLM runs only in a container: use 'container'")
    image = data.get("image", instance.image if instance else "")
    if delivery == "process":
        if image not in (None, ""):
            raise _invalid("image", "only a model with delivery 'container' has an image")
        return delivery, ""
    try:
        return delivery, str(parse_image(image, "image"))
    except ImageRefused as exc:
        raise _invalid("image", str(exc).removeprefix("image ")) from None


def clean_vllm_settings(raw: Any) -> vllm.VllmSettings:
    """vLLM settings parsed, else 400 vllm_settings_invalid naming every bad field."""
    return _typed_settings(vllm.VllmSettings.from_dict, raw, "vllm_settings_invalid")


def _typed_settings(parse: Callable[[dict[str, Any]], T], raw: Any, code: str) -> T:
    """A runtime's settings through its ``parse``; 400 ``code`` naming every bad field."""
    if not isinstance(raw, dict):
        raise _invalid("settings", "must be an object")
    try:
        return parse(raw)
    except llamacpp.SettingsError as exc:
        first = next(iter(exc.errors))
        raise ServiceError(
            400,
            code,
            f"settings.{first}: {exc.errors[first]}",
            details={"fields": {f"settings.{k}": v for k, v in exc.errors.items()}},
        ) from None


def clean_source_file(file: Any) -> str:
    """A .gguf file name inside the model folder (no path), else 400 naming source_file.

    The name follows the agent's own rule (protocol.names.path_name_problem).
    """
    problem = path_name_problem(file)
    if problem is not None or not file.endswith(".gguf"):
        why = f" ({file!r} {problem})" if problem and isinstance(file, str) else ""
        raise _invalid("source_file", "name a .gguf file inside the folder (no path)" + why)
    return str(file)


def clean_settings(raw: Any) -> llamacpp.LlamaCppSettings:
    """llama.cpp settings parsed, else 400 llamacpp_settings_invalid naming every bad field."""
    return _typed_settings(llamacpp.LlamaCppSettings.from_dict, raw, "llamacpp_settings_invalid")


def _resolve_node(node_id: Any) -> Node:
    if not isinstance(node_id, str):
        raise _invalid("node", "name the node id to place the model on")
    node = Node.objects.filter(node_id=node_id).first()
    if node is None or node.revoked:
        raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
    if not node.approved:
        raise ServiceError(
            409, "invalid_state", f"Node '{node_id}' is not approved yet; approve it first."
        )
    return node


GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{8,64}$")


def _clean_placements(data: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``placements`` (or the ``node`` shorthand) checked; None when neither was given.

    Each item is ``{"node", "gpuUuids"?, "gpuBudgets"?}``. GPU UUIDs must be
    ones the node reported; budgets, when given, name every GPU of the item.
    """
    if "placements" in data and "node" in data:
        raise _invalid("placements", "give either placements or node, not both")
    if "node" in data:
        raw: Any = [] if data["node"] is None else [{"node": data["node"]}]
    elif "placements" in data:
        raw = data["placements"]
    else:
        return None
    if not isinstance(raw, list) or len(raw) > 64:
        raise _invalid("placements", "must be a list of at most 64 {node, gpuUuids} objects")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        field = f"placements[{i}]"
        if not isinstance(item, dict) or set(item) - {"node", "gpuUuids", "gpuBudgets"}:
            raise _invalid(field, "must be an object with node, gpuUuids and gpuBudgets only")
        node = _resolve_node(item.get("node"))
        if node.node_id in seen:
            raise _invalid(field, f"node '{node.node_id}' is listed twice; replicas need "
                           "different nodes")  # fmt: skip
        seen.add(node.node_id)
        uuids = item.get("gpuUuids") or []
        if (
            not isinstance(uuids, list)
            or len(uuids) > 16
            or len(set(uuids)) != len(uuids)
            or not all(isinstance(u, str) and GPU_UUID.fullmatch(u) for u in uuids)
        ):
            raise _invalid(f"{field}.gpuUuids", "must be a list of distinct GPU UUIDs (GPU-...)")
        known = {g.get("uuid") for g in (node.facts or {}).get("gpus") or [] if isinstance(g, dict)}
        unknown = [u for u in uuids if u not in known]
        if unknown:
            have = ", ".join(sorted(k for k in known if k)) or "none"
            raise _invalid(
                f"{field}.gpuUuids",
                f"node '{node.node_id}' has no GPU {unknown[0]} (it reported: {have})",
            )
        budgets = item.get("gpuBudgets") or []
        if not isinstance(budgets, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in budgets
        ):
            raise _invalid(f"{field}.gpuBudgets", "must be a list of positive byte counts")
        if budgets and len(budgets) != len(uuids):
            raise _invalid(
                f"{field}.gpuBudgets",
                f"names {len(budgets)} budgets for {len(uuids)} GPUs; a partial per-GPU "
                "budget map is refused, name every GPU or none",
            )
        out.append({"node": node, "gpu_uuids": uuids, "gpu_budgets": budgets})
    return out


def _apply_placements(model: ModelDefinition, wanted: list[dict[str, Any]]) -> None:
    """Make the model's placements match ``wanted``, keeping the rows of nodes still listed.

    Keeping rows keeps instance ids stable, so a replica added to a running model
    does not orphan the ones already running. Removing a replica of a running
    model is refused: its engine would keep running with nothing pointing at it.
    """
    current = {p.node_id: p for p in model.placements.all()}
    wanted_ids = {item["node"].pk for item in wanted}
    removed = [p for node_pk, p in current.items() if node_pk not in wanted_ids]
    if removed and model.desired_state == ModelDefinition.Desired.RUNNING:
        raise ServiceError(
            409,
            "model_running",
            f"Model '{model.served_name}' is running on {removed[0].node.node_id}; stop it "
            "before removing that placement.",
        )
    for gone in removed:
        gone.delete()
    for item in wanted:
        placement = current.get(item["node"].pk)
        if placement is None:
            Placement.objects.create(
                model=model,
                node=item["node"],
                gpu_uuids=item["gpu_uuids"],
                gpu_budgets=item["gpu_budgets"],
            )
        elif (placement.gpu_uuids, placement.gpu_budgets) != (
            item["gpu_uuids"],
            item["gpu_budgets"],
        ):
            placement.gpu_uuids = item["gpu_uuids"]
            placement.gpu_budgets = item["gpu_budgets"]
            placement.save(update_fields=["gpu_uuids", "gpu_budgets"])


def _clean_budget(data: dict[str, Any]) -> dict[str, Any]:
    if "memory_budget_bytes" not in data:
        return {}
    value = data["memory_budget_bytes"]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise _invalid(
            "memoryBudgetBytes", "must be a positive byte count, or null for the estimate"
        )
    return {"memory_budget_bytes": value}


def _budget_for(data: dict[str, Any], cleaned: dict[str, Any]) -> dict[str, Any]:
    """The manual budget; a vLLM model has none: it takes its share of each GPU (D89)."""
    budget = _clean_budget(data)
    if cleaned["runtime"] != "vllm":
        return budget
    if budget.get("memory_budget_bytes"):
        raise _invalid(
            "memoryBudgetBytes",
            "vLLM takes settings.gpu_memory_utilization of each placed GPU; set that instead",
        )
    return {"memory_budget_bytes": None}


@transaction.atomic
def create_model(data: dict[str, Any]) -> ModelDefinition:
    """Create a definition and, when ``node`` or ``placements`` is given, its placements."""
    cleaned = validate_definition(data)
    cleaned |= _budget_for(data, cleaned)
    placements = _clean_placements(data)
    model = ModelDefinition.objects.create(**cleaned)
    if placements:
        _apply_placements(model, placements)
    log.info("Created model %s (%s)", model.served_name, model.pk)
    return model


@transaction.atomic
def update_model(model: ModelDefinition, data: dict[str, Any]) -> ModelDefinition:
    """Change a definition; a running instance shows "restart pending" until restarted."""
    cleaned = validate_definition(data, instance=model)
    cleaned |= _budget_for(data, cleaned)
    placements = _clean_placements(data)
    for key, value in cleaned.items():
        setattr(model, key, value)
    model.save()
    if placements is not None:
        _apply_placements(model, placements)
    return model


def delete_model(model: ModelDefinition) -> None:
    """Delete a definition and its placements; a model meant to run is refused (409)."""
    if model.desired_state == ModelDefinition.Desired.RUNNING:
        raise ServiceError(409, "model_running", "Stop the model before deleting it.")
    _refuse_if_routed(model, "delete")
    model.delete()
    log.info("Deleted model %s", model.served_name)


def get_model(model_id: int) -> ModelDefinition:
    model = ModelDefinition.objects.filter(pk=model_id).first()
    if model is None:
        raise ServiceError(404, "not_found", f"Model {model_id} does not exist.")
    return model


# The best replica wins: a lower rank; any other state ranks after these.
_RANK: dict[str, int] = {
    InstanceState.READY: 0,
    InstanceState.STARTING: 1,
    InstanceState.FAILED: 2,
    InstanceState.STOPPED: 3,
}
Replica = tuple[str, str]  # (node id, instance id)


def replicas_state(replicas: Iterable[Replica], statuses: dict[str, NodeStatus]) -> dict[str, Any]:
    """A model's state over its replicas, from effective node statuses (the one rule).

    ``statuses`` comes from ``nodes.status.read_many``: the best replica wins (Ready,
    then Starting, Failed, Stopped); a replica whose node is not serving is Offline; a
    model with no replica is Unplaced. Plain (node id, instance id) pairs, so the
    Overview can judge the whole registry without loading a model or a placement.
    """
    best: dict[str, Any] | None = None
    best_rank = 10
    for node_id, instance_id in replicas:
        status = statuses.get(node_id)
        if not node_status.is_serving(status):
            state, error = "Offline", None
        else:
            assert status is not None
            inst = (status.get("instances") or {}).get(instance_id)
            if inst is None:
                state, error = "Stopped", None
            else:
                state, error = inst.get("state", "Stopped"), inst.get("error")
        rank = _RANK.get(state, 9)
        if best is None or rank < best_rank:
            best, best_rank = {"state": state, "nodeId": node_id, "error": error}, rank
    return best or {"state": "Unplaced", "nodeId": None, "error": None}


def model_state(model: ModelDefinition, statuses: dict[str, NodeStatus]) -> dict[str, Any]:
    """The model's state over all its replicas (:func:`replicas_state`)."""
    return replicas_state(
        ((p.node.node_id, p.instance_id) for p in model.placements.all()), statuses
    )


def all_replicas() -> dict[int, list[Replica]]:
    """Every model's replicas by model id, in placement order: one query of three columns
    (no model or placement instances, no ``IN`` of ids), for a read of the whole registry."""
    found: dict[int, list[Replica]] = {}
    rows = Placement.objects.order_by("id").values_list("model_id", "id", "node__node_id")
    for model_id, pk, node_id in rows:
        found.setdefault(model_id, []).append((node_id, Placement.instance_id_of(model_id, pk)))
    return found


def model_summary(model: ModelDefinition, statuses: dict[str, NodeStatus]) -> ModelSummary:
    """A model's Overview row: the page renders it and ``model.updated`` carries it.

    One function for both, so a live update shows what a reload would: the state over
    all replicas (:func:`model_state`), restarts and measured memory summed over them.
    """
    state = model_state(model, statuses)
    measured: int | None = None
    restarts = 0
    for placement in model.placements.all():
        inst = ((statuses.get(placement.node.node_id) or {}).get("instances") or {}).get(
            placement.instance_id
        )
        if not inst:
            continue
        restarts += int(inst.get("restartCount") or 0)
        value = (inst.get("measured") or {}).get("bytes")
        if isinstance(value, int):
            measured = (measured or 0) + value
    return ModelSummary(
        modelId=model.pk,
        servedName=model.served_name,
        state=str(state["state"]),
        nodeId=state["nodeId"],
        error=state["error"],
        restartCount=restarts,
        measuredBytes=measured,
    )


def model_rows(node_id: str, model_ids: list[int] | None) -> list[ModelSummary]:
    """The rows of the models placed on ``node_id`` (only ``model_ids`` when given).

    The monitor's ``model.updated`` events (through ``nodes.hooks``): read after it
    wrote the node's new record, so the row aggregates that record with the others.
    """
    models = ModelDefinition.objects.filter(placements__node__node_id=node_id)
    if model_ids is not None:
        models = models.filter(pk__in=model_ids)
    listed = list(models.distinct().order_by("pk").prefetch_related("placements__node"))
    statuses = node_status.read_many({p.node for m in listed for p in m.placements.all()})
    return [model_summary(model, statuses) for model in listed]
