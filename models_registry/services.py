"""Model definitions: create, place, build launch specs, start and stop.

The answers follow seed 000 section 7 ("Admin API answers for model
commands"): 404 unknown model, 409 for conflicts the operator must resolve
(unplaced, node not registered, revoked or draining), 503 when the node is not
serving or cannot be reached, 422 when the agent refuses the spec.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from django.db import transaction

from mirbad_site.errors import ServiceError
from models_registry import llamacpp
from models_registry.models import ModelDefinition, Placement
from nodes import status_cache
from nodes.agent_client import AgentClient, AgentRefused, AgentUnreachable
from nodes.models import Node
from nodes.states import SERVING

log = logging.getLogger("mirbad.models")

SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


def _invalid(field: str, message: str) -> ServiceError:
    return ServiceError(400, "invalid_request", f"{field}: {message}", details={"field": field})


def validate_definition(data: dict[str, Any], *, instance: ModelDefinition | None = None) -> dict:
    """Check a definition's fields; returns the cleaned values or raises 400 naming the field."""
    cleaned: dict[str, Any] = {}
    served = data.get("served_name", instance.served_name if instance else None)
    if not isinstance(served, str) or not SERVED_NAME.match(served):
        raise _invalid(
            "served_name",
            "use 1-200 letters, digits and . _ : / @ + - (no spaces or commas), "
            "starting with a letter or digit",
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
    cleaned["served_name"] = served
    runtime = data.get("runtime", instance.runtime if instance else "llamacpp")
    if runtime != "llamacpp":
        raise _invalid("runtime", "only 'llamacpp' is available in this version")
    cleaned["runtime"] = runtime
    cleaned["delivery"] = "process"
    folder = data.get("source_folder", instance.source_folder if instance else None)
    if (
        not isinstance(folder, str)
        or not re.match(r"^[A-Za-z0-9._-]{1,200}$", folder)
        or (folder in (".", ".."))
    ):
        raise _invalid("source_folder", "use 1-200 letters, digits, '.', '_' or '-'")
    cleaned["source_folder"] = folder
    file = data.get("source_file", instance.source_file if instance else None)
    if not isinstance(file, str) or not FILE_NAME.match(file) or not file.endswith(".gguf"):
        raise _invalid("source_file", "name a .gguf file inside the folder (no path)")
    cleaned["source_file"] = file
    raw_settings = data.get("settings", instance.settings if instance else {})
    if not isinstance(raw_settings, dict):
        raise _invalid("settings", "must be an object")
    try:
        cleaned["settings"] = llamacpp.LlamaCppSettings.from_dict(raw_settings).to_dict()
    except llamacpp.SettingsError as exc:
        first = next(iter(exc.errors))
        raise ServiceError(
            400,
            "llamacpp_settings_invalid",
            f"settings.{first}: {exc.errors[first]}",
            details={"fields": {f"settings.{k}": v for k, v in exc.errors.items()}},
        ) from None
    if "auto_start" in data:
        if not isinstance(data["auto_start"], bool):
            raise _invalid("auto_start", "must be true or false")
        cleaned["auto_start"] = data["auto_start"]
    return cleaned


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


@transaction.atomic
def create_model(data: dict[str, Any]) -> ModelDefinition:
    """Create a definition and, when ``node`` is given, its placement."""
    cleaned = validate_definition(data)
    node = _resolve_node(data["node"]) if data.get("node") is not None else None
    model = ModelDefinition.objects.create(**cleaned)
    if node is not None:
        Placement.objects.create(model=model, node=node)
    log.info("Created model %s (%s)", model.served_name, model.pk)
    return model


@transaction.atomic
def update_model(model: ModelDefinition, data: dict[str, Any]) -> ModelDefinition:
    cleaned = validate_definition(data, instance=model)
    for key, value in cleaned.items():
        setattr(model, key, value)
    model.save()
    if "node" in data:
        model.placements.all().delete()
        if data["node"] is not None:
            Placement.objects.create(model=model, node=_resolve_node(data["node"]))
    return model


def get_model(model_id: int) -> ModelDefinition:
    model = ModelDefinition.objects.filter(pk=model_id).first()
    if model is None:
        raise ServiceError(404, "not_found", f"Model {model_id} does not exist.")
    return model


def launch_spec(model: ModelDefinition, placement: Placement) -> dict[str, Any]:
    """The agent's launch request: the canonical argv built here, nowhere else."""
    settings = llamacpp.LlamaCppSettings.from_dict(model.settings)
    argv = llamacpp.build_argv(settings=settings, served_name=model.served_name)
    return {
        "instanceId": placement.instance_id,
        "modelId": model.pk,
        "servedName": model.served_name,
        "runtime": model.runtime,
        "delivery": model.delivery,
        "executable": {"name": "llama.cpp", "version": model.executable_version or None},
        "model": {"folder": model.source_folder, "file": model.source_file},
        "args": argv,
        "env": {},
    }


def _placements(model: ModelDefinition) -> list[Placement]:
    placements = list(model.placements.select_related("node"))
    if not placements:
        raise ServiceError(
            409, "model_unplaced", f"Model '{model.served_name}' has no placement; place it first."
        )
    return placements


def _check_node_for_start(node: Node) -> None:
    if node.revoked:
        raise ServiceError(409, "node_revoked", f"Node '{node.node_id}' is revoked.")
    if not node.approved:
        raise ServiceError(409, "invalid_state", f"Node '{node.node_id}' is not approved yet.")
    if node.draining:
        raise ServiceError(
            409, "node_draining", f"Node '{node.node_id}' is draining; no new starts."
        )
    status = status_cache.read(node.node_id)
    state = status.get("state") if status else "Offline"
    if state not in SERVING:
        raise ServiceError(
            503,
            "node_not_serving",
            f"Node {node.node_id} is not serving (state: {state}); the model cannot start now.",
        )


def _agent_error(node: Node, exc: Exception) -> ServiceError:
    if isinstance(exc, AgentUnreachable):
        return ServiceError(503, "node_unreachable", f"Node {node.node_id}: {exc}")
    assert isinstance(exc, AgentRefused)
    if exc.code in ("stale_master", "competing_master"):
        # Another master drives this node: it is not serving us (PendingTakeover).
        return ServiceError(
            503,
            exc.code,
            f"Node {node.node_id} refused this master ({exc.code}): {exc.message}. "
            "If this master should own the node, run a takeover.",
        )
    status = exc.status if exc.status in (400, 404, 409, 422, 501, 503, 504) else 502
    return ServiceError(status, exc.code, f"Node {node.node_id}: {exc.message}")


def start_model(model_id: int) -> dict[str, Any]:
    """Ask each placement's agent to launch the model; answers the agents' instances."""
    model = get_model(model_id)
    placements = _placements(model)
    for placement in placements:
        _check_node_for_start(placement.node)
    instances = []
    for placement in placements:
        spec = launch_spec(model, placement)
        try:
            with AgentClient(node=placement.node) as client:
                instances.append(client.launch(spec))
        except (AgentUnreachable, AgentRefused) as exc:
            raise _agent_error(placement.node, exc) from exc
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="running")
    log.info("Start of model %s sent to %d node(s)", model.served_name, len(placements))
    return {"modelId": model.pk, "servedName": model.served_name, "instances": instances}


def stop_model(model_id: int) -> dict[str, Any]:
    """Stop every replica; a node that cannot be reached is a 503, nothing is assumed."""
    model = get_model(model_id)
    placements = _placements(model)
    instances = []
    for placement in placements:
        try:
            with AgentClient(node=placement.node) as client:
                instances.append(client.stop(placement.instance_id))
        except AgentRefused as exc:
            if exc.code == "not_found":
                continue  # never launched there: already stopped
            raise _agent_error(placement.node, exc) from exc
        except AgentUnreachable as exc:
            raise _agent_error(placement.node, exc) from exc
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="stopped")
    return {"modelId": model.pk, "servedName": model.served_name, "instances": instances}


def model_state(
    model: ModelDefinition, statuses: dict[str, status_cache.NodeStatus | None]
) -> dict[str, Any]:
    """The model's state as the console shows it, from the node status cache."""
    placements = list(model.placements.all())
    if not placements:
        return {"state": "Unplaced", "nodeId": None, "error": None}
    best: dict[str, Any] | None = None
    order = {"Ready": 0, "Starting": 1, "Failed": 2, "Stopped": 3}
    for placement in placements:
        node_id = placement.node.node_id
        status = statuses.get(node_id)
        if status is None or status.get("state") not in SERVING:
            candidate = {"state": "Offline", "nodeId": node_id, "error": None}
        else:
            inst = (status.get("instances") or {}).get(placement.instance_id)
            if inst is None:
                candidate = {"state": "Stopped", "nodeId": node_id, "error": None}
            else:
                candidate = {
                    "state": inst.get("state", "Stopped"),
                    "nodeId": node_id,
                    "error": inst.get("error"),
                }
        if best is None or order.get(candidate["state"], 9) < order.get(best["state"], 9):
            best = candidate
    assert best is not None
    return best
