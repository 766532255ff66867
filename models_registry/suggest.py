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

import datetime
import json
import operator
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson
from django.db.models import TextField
from django.db.models.functions import Cast

from core.errors import ServiceError
from models_registry import admission, lifecycle, vllm
from models_registry.models import ModelDefinition
from models_registry.services import get_model
from nodes import status as node_status
from nodes.listing import IN_MAX
from nodes.models import DEFAULT_GPU_RESERVE_BYTES, Node
from protocol.states import InstanceState

# What the ranking reads of every node (the rule of nodes.status, admission, the engine
# checks) and what an agent call to a holder needs; the certificate and time stamp
# columns are left out: converting four datetimes a row was a tenth of the answer at
# 1,000 nodes (issue 19). A field that a Node made of a row (_Row.node) reads and that
# is not listed costs a query per node.
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

# The columns read, in the model's field order (Node.from_db takes them so).
_COLUMNS = tuple(
    f.attname for f in Node._meta.concrete_fields if f.primary_key or f.attname in _NODE_FIELDS
)
# What a row reads of its columns (_Row.__init__), by position.
_PICK = operator.itemgetter(
    *(
        _COLUMNS.index(name)
        for name in (
            "node_id",
            "approved",
            "revoked",
            "draining",
            "maintenance_until",
            "facts",
            "memory_reserve_bytes",
            "gpu_reserves",
        )
    )
)


class _Reserving(admission.HasFacts, Protocol):
    """What the admission lines read of a node: a ``Node``, or a :class:`_Row`."""

    @property
    def memory_reserve_bytes(self) -> int: ...

    def gpu_reserve(self, uuid: str) -> int: ...


class _Row:
    """An approved node as the ranking reads it, with no model instance.

    Reading 1,000 nodes as ``Node`` instances took 11 ms of CPU, 19 ms with an agent's
    kilobyte of facts (JSONField decodes them with json); as rows 3.4 ms and 9.6 ms
    (issue 19). A ``Node`` is made (:meth:`node`) only where one is handed on: a holder's
    agent call, lifecycle's container check, a node on maintenance hold; its rules stay
    ``Node``'s.
    """

    __slots__ = (
        "_db",
        "_node",
        "_values",
        "approved",
        "draining",
        "facts",
        "gpu_reserves",
        "maintenance_until",
        "memory_reserve_bytes",
        "node_id",
        "revoked",
    )
    node_id: str
    approved: bool
    revoked: bool
    draining: bool
    maintenance_until: datetime.datetime | None
    facts: Any
    memory_reserve_bytes: int
    gpu_reserves: Any

    def __init__(self, db: str, values: list[Any]) -> None:
        """``values``: the _COLUMNS, JSON decoded."""
        self._db, self._values = db, values
        self._node: Node | None = None
        (
            self.node_id,
            self.approved,
            self.revoked,
            self.draining,
            self.maintenance_until,
            self.facts,
            self.memory_reserve_bytes,
            self.gpu_reserves,
        ) = _PICK(values)

    def node(self) -> Node:
        """The row as a ``Node`` with the columns read (``Node.from_db``, as a query makes it)."""
        if self._node is None:
            self._node = Node.from_db(self._db, _COLUMNS, self._values)
        return self._node

    def maintenance_left(self) -> float:
        return self.node().maintenance_left() if self.maintenance_until is not None else 0.0

    def gpu_reserve(self, uuid: str) -> int:
        # A GPU absent from gpu_reserves gets the default (Node.gpu_reserve).
        return self.node().gpu_reserve(uuid) if self.gpu_reserves else DEFAULT_GPU_RESERVE_BYTES


def _json(raw: str | None) -> Any:
    """A JSON column read as text, decoded as ``JSONField`` decodes it (``json``)."""
    if raw is None or raw == "{}":  # most reserve maps: no decoder at all
        return None if raw is None else {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # JSONField's own fallback


def _facts(raw: str | None) -> Any:
    """The facts column read as text, decoded with orjson (D143): about a kilobyte a node,
    2.4 us each where ``json`` takes 6."""
    try:
        facts = orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:  # NaN, a lone surrogate: json's answer, as before
        return _json(raw)
    # orjson reads an integer past 64 bits as a float where json keeps an int. Of the facts
    # the ranking reads numbers only in the GPUs (admission.node_gpus): one such there, and
    # the facts are json's.
    gpus = facts.get("gpus") if isinstance(facts, dict) else None
    if isinstance(gpus, list) and any(
        isinstance(v, float) and abs(v) >= 2**63
        for gpu in gpus
        if isinstance(gpu, dict)
        for v in gpu.values()
    ):
        return _json(raw)
    return facts


# The JSON columns, read as text and decoded here (JSONField decodes each with json).
_DECODE: dict[str, Callable[[str | None], Any]] = {"facts": _facts, "gpu_reserves": _json}
_JSON_AT = tuple((_COLUMNS.index(name), decode) for name, decode in _DECODE.items())


def _rows() -> list[_Row]:
    """Every approved, unrevoked node in node-id order, in one query."""
    texts = {f"{name}_text": Cast(name, TextField()) for name in _DECODE}
    queryset = (
        Node.objects.filter(approved=True, revoked=False)
        .order_by("node_id")
        .annotate(**texts)
        .values_list(*(f"{n}_text" if f"{n}_text" in texts else n for n in _COLUMNS))
    )
    rows = []
    db = queryset.db
    for selected in queryset:
        values = list(selected)
        for i, decode in _JSON_AT:
            values[i] = decode(values[i])
        rows.append(_Row(db, values))
    return rows


def _holds(status: Mapping[str, Any], folder: str) -> bool:
    weights = (status.get("telemetry") or {}).get("weights") or []
    return any(isinstance(w, dict) and w.get("folder") == folder for w in weights)


_CONTAINER = ModelDefinition.Delivery.CONTAINER.value  # an enum member's lookup, per node


def _engine(node: _Row, model: ModelDefinition) -> bool | None:
    """Whether the node can run the model's engine: for a container the runtime it
    offers (lifecycle.check_node_offers' rule), for a process its llama.cpp build."""
    if model.delivery == _CONTAINER:
        try:
            lifecycle.check_node_offers(model, node.node())
        except ServiceError:
            return False
        return True
    executables = (node.facts or {}).get("executables")
    if not executables:
        return None  # unknown: an agent that does not report its engines
    return any(e.get("name") == "llama.cpp" and e.get("verified", True) for e in executables)


def _vllm_line(
    node: _Reserving,
    status: Mapping[str, Any],
    settings: vllm.VllmSettings,
    starting: dict[str | None, int],
) -> tuple[bool, list[str], str]:
    """vLLM on the node's roomiest GPU: its gpu_memory_utilization share of that card
    (lifecycle.vllm_estimate's rule, D89); (fits, GPUs, reason).

    The roomiest is the first GPU with the most free bytes left after its share
    (``(free or -1) - share``, the ranking of every GPU's admission line), and only its
    line is made.
    """
    gpus = admission.node_gpus(node, status)
    if not gpus:
        return False, [], "no GPU: vLLM needs GPUs"
    best: tuple[str, dict[str, Any], int, int] | None = None
    room = 0
    for uuid, gpu in gpus.items():
        share = vllm.memory_budget_bytes(settings, [int(gpu.get("memoryTotalBytes") or 0)])[0]
        reserve = node.gpu_reserve(uuid)
        left = (admission.gpu_free(gpu, reserve, starting.get(uuid, 0)) or -1) - share
        if best is None or left > room:
            best, room = (uuid, gpu, share, reserve), left
    assert best is not None
    uuid, gpu, share, reserve = best
    line = admission.gpu_line(uuid, gpu, share, reserve, starting.get(uuid, 0))
    return line.fits, [uuid] if line.fits and uuid else [], line.text()


def _budget_line(
    node: _Reserving, status: Mapping[str, Any], budget: int, starting: dict[str | None, int]
) -> tuple[bool, list[str], str]:
    """A GGUF budget on the node's roomiest GPU, or in its host memory without GPUs.

    The roomiest GPU is picked first (the first of the most free bytes, as ranking every
    GPU's admission line did) and only its line is made: each GPU's reserve and free
    bytes are read once, not once more by a full admission check (issue 19). The budget
    of a one-GPU placement is its share whole (admission.split_budget of one GPU).
    """
    gpus = admission.node_gpus(node, status)
    if not gpus:
        line = admission.host_line(status, budget, node.memory_reserve_bytes, starting.get(None, 0))
        return line.fits, [], line.text()
    best: tuple[str, dict[str, Any], int] | None = None
    most = 0
    for uuid, gpu in gpus.items():
        reserve = node.gpu_reserve(uuid)
        # The comparison the ranking of every line made: `(line.free or -1)`.
        free = admission.gpu_free(gpu, reserve, starting.get(uuid, 0)) or -1
        if best is None or free > most:
            best, most = (uuid, gpu, reserve), free
    assert best is not None
    uuid, gpu, reserve = best
    line = admission.gpu_line(uuid, gpu, budget, reserve, starting.get(uuid, 0))
    return line.fits, [uuid] if line.fits and uuid else [], line.text()


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


def _models_disk_free(status: Mapping[str, Any]) -> int | None:
    disks = (status.get("telemetry") or {}).get("disks") or []
    if disks and isinstance(disks[0], dict) and isinstance(disks[0].get("freeBytes"), int):
        return disks[0]["freeBytes"]  # the agent lists the models root first
    return None


HeaderReader = Callable[[ModelDefinition, Node], dict[str, Any]]


def _budget_and_size(
    model: ModelDefinition, holders: list[_Row], read_header: HeaderReader
) -> tuple[int | None, int | None]:
    """The budget (from a node holding the file, else the last estimate) and the file size."""
    estimate = model.estimate or {}
    for node in holders:
        try:
            header = read_header(model, node.node())
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
    nodes = _rows()
    statuses = node_status.read_many(nodes)
    holds = {n.node_id: _holds(statuses[n.node_id], model.source_folder) for n in nodes}
    holders = [n for n in nodes if holds[n.node_id] and node_status.is_serving(statuses[n.node_id])]
    vllm_model = model.runtime == ModelDefinition.Runtime.VLLM
    # vLLM's budget is a share of each card, not a file's estimate (D89).
    budget, size = (None, None) if vllm_model else _budget_and_size(model, holders, read_header)
    starting = _starting_budgets(statuses)
    vllm_settings = (
        vllm.saved_settings(model.settings, model=model.served_name) if vllm_model else None
    )
    container = model.delivery == ModelDefinition.Delivery.CONTAINER
    not_offered = (
        f"does not offer {model.runtime} as a {model.delivery}"
        if container
        else "llama.cpp is not installed"
    )
    candidates = []
    for node in nodes:
        status = statuses[node.node_id]
        state = node_status.state_of(status)
        serving = node_status.is_serving(status)
        reasons: list[str] = []
        engine = _engine(node, model)
        gpus: list[str] = []
        fits = False
        if not serving:
            reasons.append(f"not serving (state: {state})")
        if node.draining:
            reasons.append("draining")
        if engine is False:
            reasons.append(not_offered)
        if vllm_settings is not None:
            fits, gpus, reason = _vllm_line(node, status, vllm_settings, starting[node.node_id])
            reasons.append(reason)
        elif budget is None:
            reasons.append("no estimate yet: no serving node holds the weights")
        else:
            fits, gpus, reason = _budget_line(node, status, budget, starting[node.node_id])
            reasons.append(reason)
        disk_ok: bool | None = True
        if not holds[node.node_id]:
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
                "holdsWeights": holds[node.node_id],
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
