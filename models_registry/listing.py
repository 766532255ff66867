"""Which models a list shows: the filters and the page of ``GET /api/models`` and the
console's Models page, one rule for both.

Filters (every one optional, all of them must match):

- ``state``: the model's state over its replicas (``services.model_state``: Ready,
  Starting, Failed, Stopped, Offline, Unplaced), repeatable or a comma list;
- ``node``: models with a replica on this node (its id);
- ``search``: a case-insensitive substring of the served name.

The definitions are read once (a few columns), and only a ``state`` filter reads every
model's placements (one query, no list of ids: SQLite refuses an ``IN`` of thousands) and
the statuses of their nodes (one ``read_many``); the page's models are then loaded whole
with their placements (docs/decisions.md (Lists of a thousand nodes: all rows up to a
cap)). :func:`judge_registry` reads every placement once for the Overview and judges it in
one pass: its model's replicas, whether it is Ready, and whether its restart is pending
(for Needs attention), memoizing each placement's expected fingerprint on exactly what
it depends on.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from django.db.models import TextField
from django.db.models.functions import Cast

from core import paging
from models_registry import kpis, lifecycle, services
from models_registry.models import ModelDefinition, Placement
from nodes import status as node_status
from nodes.models import Node
from nodes.status_cache import NodeStatus
from protocol.states import InstanceState

STATES = (*(s.value for s in InstanceState), "Offline", "Unplaced")
# A page of more models than this is loaded without an IN list of their ids.
IN_MAX = 500


@dataclass(frozen=True, slots=True)
class ModelFilter:
    """What a reader asked for; the defaults match every model."""

    states: frozenset[str] = frozenset()
    node: str = ""
    search: str = ""

    @property
    def active(self) -> bool:
        return bool(self.states or self.node or self.search)


@dataclass(slots=True)
class ModelPage:
    """The page's models (placements and their nodes loaded) and the counts."""

    models: list[ModelDefinition]
    count: int  # models matching the filter
    total: int  # models defined


def parse_filter(params: Any, *, search_name: str = "search") -> ModelFilter:
    """``state``, ``node`` and ``search`` (the console calls it ``q``) from query
    parameters; a bad value is a 400 naming the parameter (core.paging)."""
    return ModelFilter(
        states=paging.choices(params, "state", STATES),
        node=paging.text(params, "node", most=40),
        search=paging.text(params, search_name, most=100),
    )


def with_placements(
    models: list[ModelDefinition], nodes: list[Node] | None = None
) -> list[ModelDefinition]:
    """``models`` with ``placements.all()`` and each placement's node loaded, in three
    queries over the whole registry whatever the count (no ``IN`` of every model's id,
    which SQLite refuses past a thousand): for a read of every model (a ``state`` filter,
    the Overview's tiles). ``nodes``: every node, when the caller has read them already."""
    by_pk = {m.pk: m for m in models}
    by_node = {n.pk: n for n in (Node.objects.all() if nodes is None else nodes)}
    grouped: dict[int, list[Placement]] = defaultdict(list)
    # What select_related leaves (the descriptors' checks cost more than the read here).
    model_field, node_field = Placement._meta.get_field("model"), Placement._meta.get_field("node")
    for placement in Placement.objects.order_by("id"):
        model = by_pk.get(placement.model_id)
        if model is None:
            continue
        model_field.set_cached_value(placement, model)
        node_field.set_cached_value(placement, by_node[placement.node_id])
        grouped[model.pk].append(placement)
    for model in models:
        # What prefetch_related leaves: the related manager answers these without a query.
        # (none() would cost more than the rest: it builds a WHERE per model.)
        cached = Placement.objects.get_queryset()
        cached._result_cache = grouped.get(model.pk, [])
        cached._prefetch_done = True  # type: ignore[attr-defined]  # Django's, not in its stubs
        cache = getattr(model, "_prefetched_objects_cache", None)
        if cache is None:
            cache = model._prefetched_objects_cache = {}  # type: ignore[attr-defined]  # Django's
        cache["placements"] = cached
    return models


def statuses_of(models: list[ModelDefinition]) -> dict[str, NodeStatus]:
    """The effective status of every node holding one of ``models`` (one round trip)."""
    return node_status.read_many(p.node for m in models for p in m.placements.all())


def select(wanted: ModelFilter, window: paging.Window) -> ModelPage:
    """The models matching ``wanted``, ordered by served name, cut to ``window``."""
    candidates = ModelDefinition.objects.order_by("served_name")
    if wanted.node:
        candidates = candidates.filter(placements__node__node_id=wanted.node)
    if wanted.search:
        candidates = candidates.filter(served_name__icontains=wanted.search)
    if wanted.states:
        # model_state reads only the placements: the definitions' other columns wait.
        found = with_placements(list(candidates.only("id", "served_name")))
        statuses = statuses_of(found)
        found = [m for m in found if services.model_state(m, statuses)["state"] in wanted.states]
        ids = [m.pk for m in found]
    else:
        ids = list(candidates.values_list("pk", flat=True))
    count = len(ids)
    shown = window.cut(ids)
    total = ModelDefinition.objects.count() if wanted.active else count
    if len(shown) <= IN_MAX:
        models = list(
            ModelDefinition.objects.filter(pk__in=shown)
            .prefetch_related("placements__node")
            .order_by("served_name")
        )
    else:  # every definition: no IN of thousands of ids (SQLite refuses one)
        keep = set(shown)
        models = with_placements(
            [m for m in ModelDefinition.objects.order_by("served_name") if m.pk in keep]
        )
    return ModelPage(models=models, count=count, total=total)


class RestartInputs(NamedTuple):
    """What a placement's expected fingerprint depends on (``lifecycle.expected_fingerprint``),
    as the database holds it (JSON as its text): the memo's key."""

    served_name: str
    runtime: str
    settings: str
    delivery: str
    image: str
    executable_version: str
    gpu_uuids: str
    gpu_budgets: str
    resolved_version: str  # the version the node reports running


def _text(column: str) -> Cast:
    return Cast(column, output_field=TextField())


# RestartInputs' columns but the last, in its order (the model's through the join).
_INPUT_COLUMNS = (
    "model__served_name",
    "model__runtime",
    _text("model__settings"),
    "model__delivery",
    "model__image",
    "model__executable_version",
    _text("gpu_uuids"),
    _text("gpu_budgets"),
)
# Expected fingerprints by their inputs (None: settings refused now). Keyed by every input,
# so no save path can leave one stale; a new process (a code change) starts empty. Emptied
# when full: a registry past this many placements computes again, as before.
_FINGERPRINTS: dict[tuple[str, ...], str | None] = {}  # a RestartInputs or its plain tuple
FINGERPRINTS_MAX = 20_000
_UNKNOWN = object()


def expected_fingerprint(inputs: RestartInputs, node_id: str) -> str | None:
    """``lifecycle.expected_fingerprint`` of ``inputs``, memoized (``node_id``: the
    placement's node, named in a refusal's text)."""
    try:
        return _FINGERPRINTS[inputs]
    except KeyError:
        pass
    model = ModelDefinition(
        served_name=inputs.served_name,
        runtime=inputs.runtime,
        settings=json.loads(inputs.settings),
        delivery=inputs.delivery,
        image=inputs.image,
        executable_version=inputs.executable_version,
    )
    placement = Placement(
        gpu_uuids=json.loads(inputs.gpu_uuids), gpu_budgets=json.loads(inputs.gpu_budgets)
    )
    Placement._meta.get_field("node").set_cached_value(placement, Node(node_id=node_id))
    found = lifecycle.expected_fingerprint(model, placement, inputs.resolved_version)
    if len(_FINGERPRINTS) >= FINGERPRINTS_MAX:
        _FINGERPRINTS.clear()
    _FINGERPRINTS[inputs] = found
    return found


class NodeRef(Protocol):
    """What the registry read needs of a node: a ``nodes.models.Node``, or a lighter row
    of the same columns (the Overview builds a Node only for the rows it shows)."""

    node_id: str


@dataclass(slots=True)
class Registry:
    """Every placement judged against the nodes' statuses (:func:`judge_registry`), for a
    page over the whole fleet (the Overview)."""

    # Each placed model's replicas in placement order (services.all_replicas's answer),
    # the models in the definitions' order (by served name, as the database sorts).
    replicas: dict[int, list[services.Replica]]
    names: dict[int, str]  # each placed model's served name, in the same order
    # Replicas Ready on a serving node (kpis.is_ready): (model id, node id, instance id),
    # what kpis.ready_flags reads; their models are Ready (services.replicas_state's best).
    ready: list[tuple[int, str, str]]
    # The models whose restart is pending (lifecycle.restart_pending on a replica).
    pending: set[int]


def judge_registry(nodes: Mapping[int, NodeRef], statuses: dict[str, NodeStatus]) -> Registry:
    """Every placement in one query (no ``IN`` of ids: SQLite refuses thousands), with the
    definition's columns its expected fingerprint depends on (JSON as text), judged in one
    pass against the nodes' effective statuses: its model's replicas, whether it is Ready
    for the flags, and whether its restart is pending. ``nodes``: every node by primary
    key, read already (a placement on a node added since is left to the next read).

    Each placement's instance is looked up once. Only a running replica that reported
    its fingerprint is checked for a pending restart (``lifecycle.may_be_pending``), and
    in a fleet that is every running one: each expected fingerprint is memoized on
    exactly what it depends on (:func:`expected_fingerprint`), so a render compares
    strings.
    """
    # Per node: its reported instances, whether it serves, its id; looked up once per row.
    reported = {}
    for pk, node in nodes.items():
        status = statuses.get(node.node_id)
        instances = (status or {}).get("instances") or {}
        reported[pk] = (instances, node_status.is_serving(status), node.node_id)
    # In the definitions' order (their Meta.ordering, sorted by the database's collation,
    # which Python's sort is not), so a page lists models as a read of them would.
    rows = Placement.objects.order_by("model__served_name", "id").values_list(
        "model_id", "id", "node_id", *_INPUT_COLUMNS
    )
    replicas: dict[int, list[services.Replica]] = {}
    names: dict[int, str] = {}
    ready: list[tuple[int, str, str]] = []
    pending: set[int] = set()
    instance_id_of, is_ready = Placement.instance_id_of, kpis.is_ready
    may_be_pending, running_version = lifecycle.may_be_pending, lifecycle.running_version
    for row in rows:  # thousands: plain tuples, a plain tuple as the memo's key
        model_id, pk, node_pk = row[0], row[1], row[2]
        found = reported.get(node_pk)
        if found is None:
            continue
        instances, serving, node_id = found
        instance_id = instance_id_of(model_id, pk)
        found_replicas = replicas.get(model_id)
        if found_replicas is None:
            found_replicas = replicas[model_id] = []
            names[model_id] = row[3]  # RestartInputs.served_name
        found_replicas.append((node_id, instance_id))
        inst = instances.get(instance_id)
        if not inst:
            continue
        if is_ready(serving, inst):
            ready.append((model_id, node_id, instance_id))
        if model_id in pending or not may_be_pending(inst):
            continue
        key = (*row[3:], running_version(inst))  # equal to its RestartInputs
        expected = _FINGERPRINTS.get(key, _UNKNOWN)
        if expected is _UNKNOWN:
            expected = expected_fingerprint(RestartInputs(*key), node_id)
        if expected != inst["fingerprint"]:
            pending.add(model_id)
    return Registry(replicas=replicas, names=names, ready=ready, pending=pending)
