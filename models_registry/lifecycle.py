"""Starting, stopping and restarting models: the estimate, admission and auto-start.

The answers follow docs/operator-guide.md ("Admin API answers for model
commands"): 404 unknown model; 409 for what the operator must resolve
(unplaced, node revoked, not approved or draining, admission refused, weights
missing); 503 when a node is not serving or cannot be reached; 504 when the
agent was sent the command but did not answer in time, so the outcome is
unknown; 422 when the agent refuses the spec.

A start, per placement: the node must be serving, the agent reads the GGUF
header (so the estimate uses the file that will really be loaded, every
split part included), the master computes the estimate (docs/operator-guide.md, "Admission,
placement and replicas"), admission checks the budget against the node's memory (see
:mod:`models_registry.admission`), and only then is the launch sent. Every
check of every placement runs before the first launch, so a refused replica
does not leave the others half started.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from core.errors import ServiceError
from models_registry import admission, llamacpp, vllm
from models_registry.estimate import GIB, EstimateError
from models_registry.models import MemorySample, ModelDefinition, Placement
from models_registry.services import get_model
from nodes import audit, fencing
from nodes import status as node_status
from nodes.agent_client import AgentClient, AgentRefused, AgentTimeout, AgentUnreachable
from nodes.models import Node
from protocol.errors import AgentCode
from protocol.states import ACTIVE, InstanceState

log = logging.getLogger("mirbad.models")


# -- launch specs and fingerprints ------------------------------------------------------


# Where a container model's folder appears inside its container (read-only).
CONTAINER_MODELS_TARGET = "/models"
# vLLM's workers share tensors through /dev/shm; Docker's default (64 MiB) is too small.
VLLM_SHM_BYTES = 16 * 2**30
ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vllm"}


def _argv(model: ModelDefinition, placement: Placement) -> list[str]:
    """The one argv of a placement: the runtime's builder, nowhere else."""
    if model.runtime == "vllm":
        settings = vllm.saved_settings(model.settings, model=model.served_name)
        try:
            return vllm.build_argv(
                settings=settings, served_name=model.served_name, gpus=len(placement.gpu_uuids)
            )
        except llamacpp.SettingsError as exc:
            name, problem = next(iter(exc.errors.items()))
            raise ServiceError(
                409,
                "vllm_settings_invalid",
                f"Model '{model.served_name}' on {placement.node.node_id}: settings.{name}: "
                f"{problem}",
            ) from None
    return llamacpp.build_argv(
        settings=llamacpp.saved_settings(model.settings, model=model.served_name),
        served_name=model.served_name,
        gpus=len(placement.gpu_uuids),
        tensor_split=placement.gpu_budgets or None,
        delivery=model.delivery,
    )


def launch_spec(model: ModelDefinition, placement: Placement) -> dict[str, Any]:
    """The agent's launch request: the canonical argv built here, nowhere else."""
    container = model.delivery == ModelDefinition.Delivery.CONTAINER
    spec: dict[str, Any] = {
        "instanceId": placement.instance_id,
        "modelId": model.pk,
        "servedName": model.served_name,
        "runtime": model.runtime,
        "delivery": model.delivery,
        "executable": {
            "name": ENGINE_NAMES.get(model.runtime, model.runtime),
            # A container's engine is its image; a process's is the node's build.
            "version": None if container else (model.executable_version or None),
        },
        "model": {"folder": model.source_folder, "file": model.source_file or None},
        "args": _argv(model, placement),
        "env": {},
    }
    if container:
        spec["container"] = {
            "image": model.image,
            "mounts": [{"source": "models", "target": CONTAINER_MODELS_TARGET, "readOnly": True}],
            "shmSizeBytes": VLLM_SHM_BYTES if model.runtime == "vllm" else None,
        }
    if placement.gpu_uuids:
        spec["gpuUuids"] = list(placement.gpu_uuids)
    return spec


def may_be_pending(instance: dict) -> bool:
    """Whether :func:`restart_pending` needs the definition for this instance: only a
    running one that reported its fingerprint (a list skips loading the other models)."""
    return instance.get("state") in ACTIVE and bool(instance.get("fingerprint"))


def restart_pending(model: ModelDefinition, placement: Placement, instance: dict | None) -> bool:
    """True when what runs no longer matches the definition (docs/operator-guide.md, "llama.cpp settings").

    The fingerprint is the canonical argv, the executable version (a container's image
    reference in its place) and the environment names; with no version pinned on a
    process model, the version the node resolved is the expected one.
    """
    if not instance or not may_be_pending(instance):
        return False
    expected = expected_fingerprint(model, placement, running_version(instance))
    return expected != instance["fingerprint"]


def running_version(instance: dict) -> str:
    """The executable version the node reports the instance running ("" when none)."""
    return str((instance.get("executable") or {}).get("version") or "")


def expected_fingerprint(
    model: ModelDefinition, placement: Placement, resolved_version: str
) -> str | None:
    """The fingerprint a start of ``placement`` now would report; None when the saved
    settings are refused now (what runs matches no startable definition: pending).

    A pure function of the definition's served name, runtime, settings, delivery, image
    and executable version, the placement's GPUs and budgets, and ``resolved_version``
    (the running one: models_registry.listing memoizes it on exactly these).
    """
    try:
        argv = _argv(model, placement)
    except ServiceError:
        return None
    if model.delivery == ModelDefinition.Delivery.CONTAINER:
        version = model.image
    else:
        version = model.executable_version or resolved_version
    return llamacpp.execution_fingerprint(argv=argv, executable_version=version, env_names=[])


# -- refusals ---------------------------------------------------------------------------


def check_node_for_start(node: Node) -> dict[str, Any]:
    """The node-level refusals; answers the node's effective status (nodes.status)."""
    if node.revoked:
        raise ServiceError(409, "node_revoked", f"Node '{node.node_id}' is revoked.")
    if not node.approved:
        raise ServiceError(409, "invalid_state", f"Node '{node.node_id}' is not approved yet.")
    if node.draining:
        raise ServiceError(
            409, "node_draining", f"Node '{node.node_id}' is draining; no new starts."
        )
    return dict(node_status.require_serving(node, "the model cannot start now"))


def agent_error(node: Node, exc: Exception) -> ServiceError:
    """The admin API's answer for an agent client error."""
    if isinstance(exc, AgentTimeout):
        return ServiceError(504, "outcome_unknown", f"{exc}. Look at the node before retrying.")
    if isinstance(exc, AgentUnreachable):
        return ServiceError(503, "node_unreachable", str(exc))  # it names the node
    assert isinstance(exc, AgentRefused)
    if exc.code in (AgentCode.STALE_MASTER, AgentCode.COMPETING_MASTER):
        # Another master drives this node: it is not serving us (PendingTakeover).
        return ServiceError(
            503,
            exc.code,
            f"Node {node.node_id} refused this master ({exc.code}): {exc.message}. "
            "If this master should own the node, run a takeover.",
        )
    status = exc.status if exc.status in (400, 404, 409, 422, 501, 503, 504) else 502
    return ServiceError(status, exc.code, f"Node {node.node_id}: {exc.message}")


def _placements(model: ModelDefinition, node_id: str | None = None) -> list[Placement]:
    placements = list(model.placements.select_related("node"))
    if not placements:
        raise ServiceError(
            409, "model_unplaced", f"Model '{model.served_name}' has no placement; place it first."
        )
    if node_id is not None:
        placements = [p for p in placements if p.node.node_id == node_id]
        if not placements:
            raise ServiceError(
                404, "not_found", f"Model '{model.served_name}' has no placement on '{node_id}'."
            )
    return placements


# -- the estimate -----------------------------------------------------------------------


def read_header(model: ModelDefinition, node: Node) -> dict[str, Any]:
    """The GGUF header summary of the model's file, read by the agent of ``node``."""
    try:
        with AgentClient(node=node) as client:
            return client.gguf(model.source_folder, model.source_file)
    except AgentRefused as exc:
        if exc.status == 404:
            raise ServiceError(
                409,
                "weights_missing",
                f"Node {node.node_id} does not hold {model.source_folder}/{model.source_file}: "
                f"{exc.message}. Download it there first (POST /api/downloads?node={node.node_id}).",
            ) from exc
        if exc.code == "gguf_invalid":
            raise ServiceError(422, "gguf_invalid", f"Node {node.node_id}: {exc.message}") from exc
        raise agent_error(node, exc) from exc
    except AgentUnreachable as exc:
        raise agent_error(node, exc) from exc


def estimate_for(model: ModelDefinition, gpus: int, header: dict[str, Any]) -> dict[str, Any]:
    """The estimate on ``gpus`` GPUs (0: host memory) and the budget admission will use.

    A manual budget on the model comes first.
    """
    settings = llamacpp.saved_settings(model.settings, model=model.served_name)
    try:
        result = admission.compute_estimate(header, settings, gpus=gpus)
    except EstimateError as exc:
        raise ServiceError(
            422, "estimate_failed", f"The estimate of '{model.served_name}' failed: {exc}"
        ) from exc
    budget = model.memory_budget_bytes or result.budget
    return {
        "breakdown": result.to_json(),
        "budgetBytes": budget,
        "budgetSource": "manual" if model.memory_budget_bytes else "estimate",
        "gpus": gpus,
        "architecture": header.get("architecture"),
        "fileType": header.get("fileType"),
        "file": f"{model.source_folder}/{model.source_file}",
        "parts": header.get("parts"),
        "computedAt": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def placement_estimate(
    model: ModelDefinition, placement: Placement, status: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The estimate admission uses for one placement, by runtime."""
    if model.runtime == "vllm":
        return vllm_estimate(model, placement, status)
    header = read_header(model, placement.node)
    return estimate_for(model, len(placement.gpu_uuids), header)


def vllm_estimate(
    model: ModelDefinition, placement: Placement, status: Mapping[str, Any] | None
) -> dict[str, Any]:
    """vLLM takes its gpu_memory_utilization share of each placed GPU's total at start.

    There is no header to read: the budget per GPU is that share of the card, which is
    what vLLM preallocates (docs/operator-guide.md, "vLLM settings (containers)").
    """
    if not placement.gpu_uuids:
        raise ServiceError(
            409,
            "admission_refused",
            f"Model '{model.served_name}' runs on vLLM, which needs GPUs: place it on "
            f"{placement.node.node_id} with gpuUuids.",
        )
    settings = vllm.saved_settings(model.settings, model=model.served_name)
    gpus = admission.node_gpus(placement.node, status)
    totals = [int(gpus.get(u, {}).get("memoryTotalBytes") or 0) for u in placement.gpu_uuids]
    shares = vllm.memory_budget_bytes(settings, totals)
    return {
        "breakdown": {},
        "budgetBytes": sum(shares),
        "gpuBudgets": shares,
        "budgetSource": "gpu-memory-utilization",
        "gpus": len(placement.gpu_uuids),
        "file": model.source_folder,
        "computedAt": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def check_node_offers(model: ModelDefinition, node: Node) -> None:
    """409 when the node's agent does not offer the model's runtime and delivery.

    Agents list ``runtime.<engine>.<delivery>`` in their features (docs/agent-api.md);
    a node that reported none (an agent older than the list) is taken to run
    llama.cpp processes only.
    """
    wanted = f"runtime.{model.runtime}.{model.delivery}"
    features = (node.facts or {}).get("features")
    offered = [f for f in features or [] if isinstance(f, str) and f.startswith("runtime.")]
    if not offered:
        offered = ["runtime.llamacpp.process"]
    if wanted not in offered:
        raise ServiceError(
            409,
            "runtime_not_offered",
            f"Node {node.node_id} does not offer {model.runtime} as a {model.delivery} (it "
            f"offers: {', '.join(o.removeprefix('runtime.') for o in offered)}). "
            + (
                'Turn on DockerEnabled in its agent.json (docs/agent.md, "Containers").'
                if model.delivery == "container"
                else "Place the model on another node."
            ),
        )


def _budget_of(model_id: Any) -> int:
    model = ModelDefinition.objects.filter(pk=model_id).first()
    if model is None:
        return 0
    estimated = int((model.estimate or {}).get("budgetBytes") or 0)
    if model.runtime == ModelDefinition.Runtime.VLLM:
        return estimated  # its GPU shares (D89); a manual budget does not apply
    return int(model.memory_budget_bytes or estimated)


def starting_budgets(status: Mapping[str, Any] | None, *, skip: str) -> dict[str | None, int]:
    """Budgets of the node's instances still Starting (not allocated yet), by GPU or host."""
    out: dict[str | None, int] = {}
    for inst in ((status or {}).get("instances") or {}).values():
        if inst.get("state") != InstanceState.STARTING or inst.get("instanceId") == skip:
            continue
        budget = _budget_of(inst.get("modelId"))
        uuids = inst.get("gpuUuids") or [None]
        for uuid in uuids:
            out[uuid] = out.get(uuid, 0) + budget // len(uuids)
    return out


def admission_lines(
    model: ModelDefinition,
    placement: Placement,
    estimate: dict[str, Any],
    status: Mapping[str, Any] | None,
) -> list[admission.Line]:
    return admission.check(
        node=placement.node,
        gpu_uuids=list(placement.gpu_uuids),
        gpu_budgets=list(estimate.get("gpuBudgets") or placement.gpu_budgets),
        budget=int(estimate["budgetBytes"]),
        status=status,
        starting_budgets=starting_budgets(status, skip=placement.instance_id),
    )


def model_estimate(model_id: int, *, node_id: str | None = None) -> dict[str, Any]:
    """GET /api/models/{id}/estimate: the breakdown and one admission line per GPU."""
    model = get_model(model_id)
    placements = _placements(model, node_id)
    answers = []
    for placement in placements:
        status = dict(node_status.read(placement.node))
        estimate = placement_estimate(model, placement, status)
        lines = admission_lines(model, placement, estimate, status)
        answers.append(
            {
                "node": placement.node.node_id,
                "instanceId": placement.instance_id,
                **estimate,
                "lines": [line.to_json() for line in lines],
                "fits": all(line.fits for line in lines),
            }
        )
        _remember_estimate(model, estimate)
    return {"modelId": model.pk, "servedName": model.served_name, "placements": answers}


def _remember_estimate(model: ModelDefinition, estimate: dict[str, Any]) -> None:
    ModelDefinition.objects.filter(pk=model.pk).update(estimate=estimate)
    model.estimate = estimate


# -- start, stop, restart ---------------------------------------------------------------


def _require_fencing() -> None:
    """Refuse before any node is contacted when this master cannot fence its commands."""
    try:
        fencing.request_headers(settings.MIRBAD.data_path)
    except fencing.FencingError as exc:
        raise ServiceError(503, "monitor_not_started", str(exc)) from None


def _prepare(model: ModelDefinition, placement: Placement, *, force: bool) -> dict[str, Any]:
    """Every check of one placement's start; answers its launch spec."""
    status = check_node_for_start(placement.node)
    _require_fencing()
    check_node_offers(model, placement.node)
    current = ((status or {}).get("instances") or {}).get(placement.instance_id)
    estimate = placement_estimate(model, placement, status)
    _remember_estimate(model, estimate)
    if current and current.get("state") in ACTIVE:
        # Already running: the agent answers it as it is (a launch is idempotent),
        # and its memory is in use already, so admission would count it twice.
        return launch_spec(model, placement)
    lines = admission_lines(model, placement, estimate, status)
    if force:
        if not all(line.fits for line in lines):
            log.warning(
                "Starting %s on %s with force despite: %s",
                model.served_name,
                placement.node.node_id,
                "; ".join(line.text() for line in lines if not line.fits),
            )
    else:
        admission.refuse_unless_fits(model.served_name, placement.node, lines)
    return launch_spec(model, placement)


def _launch(placement: Placement, spec: dict[str, Any]) -> dict[str, Any]:
    try:
        with AgentClient(node=placement.node) as client:
            return client.launch(spec)
    except (AgentUnreachable, AgentRefused) as exc:
        raise agent_error(placement.node, exc) from exc


def start_model(
    model_id: int, *, force: bool = False, node_id: str | None = None
) -> dict[str, Any]:
    """Start every placement (or the one on ``node_id``) after admission; answers instances."""
    model = get_model(model_id)
    placements = _placements(model, node_id)
    specs = [(p, _prepare(model, p, force=force)) for p in placements]
    instances = [_launch(p, spec) for p, spec in specs]
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="running", auto_start_note="")
    log.info("Start of model %s sent to %d node(s)", model.served_name, len(placements))
    _audit("model.started", model, placements, force=force)
    return {"modelId": model.pk, "servedName": model.served_name, "instances": instances}


def _stop(placement: Placement) -> dict[str, Any] | None:
    try:
        with AgentClient(node=placement.node) as client:
            return client.stop(placement.instance_id)
    except AgentRefused as exc:
        if exc.code == AgentCode.NOT_FOUND:
            return None  # never launched there: already stopped
        raise agent_error(placement.node, exc) from exc
    except AgentUnreachable as exc:
        raise agent_error(placement.node, exc) from exc


def _audit(action: str, model: ModelDefinition, placements: list[Placement], **detail: Any) -> None:
    """One audit event per node the command reached (the node page lists its own)."""
    for placement in placements:
        audit.record(action, node_id=placement.node.node_id, subject=model.served_name,
                     modelId=model.pk, **detail)  # fmt: skip


def stop_model(model_id: int, *, node_id: str | None = None) -> dict[str, Any]:
    """Stop every replica; a node that cannot be reached is a 503, nothing is assumed."""
    model = get_model(model_id)
    placements = _placements(model, node_id)
    instances = [i for i in (_stop(p) for p in placements) if i is not None]
    if node_id is None:
        ModelDefinition.objects.filter(pk=model.pk).update(desired_state="stopped")
    _audit("model.stopped", model, placements)
    return {"modelId": model.pk, "servedName": model.served_name, "instances": instances}


def restart_model(
    model_id: int, *, force: bool = False, node_id: str | None = None
) -> dict[str, Any]:
    """Stop then start with the current definition (what clears "restart pending").

    The checks that do not depend on the engine's own memory run before the stop,
    so a restart on a node that is draining or offline leaves the model running.
    """
    model = get_model(model_id)
    placements = _placements(model, node_id)
    for placement in placements:
        check_node_for_start(placement.node)
    _require_fencing()
    for placement in placements:
        _stop(placement)
    instances = []
    for placement in placements:
        instances.append(_launch(placement, _prepare(model, placement, force=force)))
    ModelDefinition.objects.filter(pk=model.pk).update(desired_state="running", auto_start_note="")
    _audit("model.restarted", model, placements, force=force)
    return {"modelId": model.pk, "servedName": model.served_name, "instances": instances}


# -- auto-start -------------------------------------------------------------------------


def autostart_node(node_id: str) -> list[dict[str, Any]]:
    """Start again the auto-start models this node lost (reboot, agent restart).

    Called by the monitor when it connects to an agent with a new boot id, so a
    node's models start one after another while nodes proceed in parallel. A
    placement is started when its model is auto-start, was running, and the
    agent reports its instance absent or Stopped (a Failed one stays Failed: a
    crash loop is not healed by retrying it). A model that does not fit is left
    stopped, and why is written on the model.
    """
    # The placements first: a master restart runs this for every node of the fleet, and
    # most have nothing to auto-start, so one query answers for them (the node's row and
    # its status were read for each, docs/performance.md).
    placements = list(
        Placement.objects.select_related("model", "node")
        .filter(
            node__node_id=node_id,
            node__revoked=False,
            node__approved=True,
            model__auto_start=True,
            model__desired_state="running",
        )
        .order_by("model__served_name")
    )
    if not placements or placements[0].node.draining:
        return []
    status = node_status.read(placements[0].node)
    instances = status.get("instances") or {}
    outcomes = []
    for placement in placements:
        inst = instances.get(placement.instance_id)
        if inst is not None and inst.get("state") != InstanceState.STOPPED:
            continue
        model = placement.model
        try:
            spec = _prepare(model, placement, force=False)
            _launch(placement, spec)
        except ServiceError as exc:
            note = f"Auto-start on {node_id} left it stopped: {exc.message}"
            ModelDefinition.objects.filter(pk=model.pk).update(auto_start_note=note[:500])
            log.warning("%s (%s)", note, model.served_name)
            outcomes.append({"model": model.served_name, "started": False, "reason": exc.message})
            continue
        ModelDefinition.objects.filter(pk=model.pk).update(auto_start_note="")
        log.info("Auto-started %s on %s", model.served_name, node_id)
        outcomes.append({"model": model.served_name, "started": True, "reason": None})
    return outcomes


# -- measured memory --------------------------------------------------------------------


def over_budget_text(budget: int | None, measured: int | None) -> str | None:
    """ "uses X GiB more than its budget" when the measurement exceeds the budget."""
    if not budget or not measured or measured <= budget:
        return None
    return f"uses {(measured - budget) / GIB:.1f} GiB more than its budget"


def record_measurement(node_id: str, instance: dict[str, Any]) -> MemorySample | None:
    """Keep one (budget, measured) pair per start of an instance, once it is measured."""
    measured = instance.get("measured") or {}
    ready_at = instance.get("readyAt")
    if not isinstance(measured.get("bytes"), int) or not ready_at:
        return None
    model_id = instance.get("modelId")
    # A missing id finds no model, as filter(pk=None) did.
    model = ModelDefinition.objects.filter(pk=model_id).first() if model_id is not None else None
    if model is None:
        return None
    estimate = model.estimate or {}
    budget = model.memory_budget_bytes or estimate.get("budgetBytes")
    if not budget:
        return None
    try:
        with transaction.atomic():
            sample, _ = MemorySample.objects.get_or_create(
                instance_id=str(instance.get("instanceId")),
                ready_at=str(ready_at),
                defaults={
                    "model": model,
                    "served_name": model.served_name,
                    "node_id": node_id,
                    "architecture": str(estimate.get("architecture") or "")[:60],
                    "file_type": str(estimate.get("fileType") or "")[:20],
                    "budget_bytes": int(budget),
                    "measured_bytes": int(measured["bytes"]),
                    "kind": str(measured.get("kind") or "")[:16],
                },
            )
    except IntegrityError:  # two monitors raced on the same start
        return None
    return sample


def estimate_accuracy() -> list[dict[str, Any]]:
    """The estimate's error per architecture, quantisation and measurement kind."""
    groups: dict[tuple[str, str, str], list[MemorySample]] = {}
    for sample in MemorySample.objects.all()[:10_000]:
        key = (sample.architecture, sample.file_type, sample.kind)
        groups.setdefault(key, []).append(sample)
    out = []
    for (arch, file_type, kind), samples in sorted(groups.items()):
        ratios = [s.measured_bytes / s.budget_bytes for s in samples if s.budget_bytes]
        out.append(
            {
                "architecture": arch,
                "fileType": file_type,
                "kind": kind,
                "samples": len(samples),
                "meanMeasuredOverBudget": round(sum(ratios) / len(ratios), 3) if ratios else None,
                "maxMeasuredOverBudget": round(max(ratios), 3) if ratios else None,
            }
        )
    return out
