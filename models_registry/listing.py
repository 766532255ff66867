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
cap)). :func:`restart_pending` answers the same question over the whole registry for
the Overview's Needs attention, reading only what the check needs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from core import paging
from models_registry import lifecycle, services
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


def _instance(statuses: dict[str, NodeStatus], node_id: str, instance_id: str) -> dict[str, Any]:
    """The instance as its node reported it, {} when it did not."""
    return ((statuses.get(node_id) or {}).get("instances") or {}).get(instance_id) or {}


def restart_pending(
    replicas: dict[int, list[services.Replica]],
    statuses: dict[str, NodeStatus],
    nodes: dict[int, Node],
) -> set[int]:
    """The models whose restart is pending (``lifecycle.restart_pending`` on a replica),
    over the registry's replicas (``services.all_replicas``) and the nodes' statuses.

    Only a model with a running replica that reported its fingerprint is a candidate
    (``lifecycle.may_be_pending``), and in a fleet that is every running one: they are
    read in two queries of the columns the check needs (``lifecycle.RESTART_FIELDS``),
    with no ``IN`` of thousands of ids (SQLite refuses one). ``nodes``: every node by
    primary key, read already.
    """
    model_ids = {
        model_id
        for model_id, found in replicas.items()
        for node_id, instance_id in found
        if lifecycle.may_be_pending(_instance(statuses, node_id, instance_id))
    }
    if not model_ids:
        return set()
    definitions = ModelDefinition.objects.only(*lifecycle.RESTART_FIELDS).order_by()
    placements = Placement.objects.only("id", "model_id", "node_id", "gpu_uuids", "gpu_budgets")
    if len(model_ids) <= IN_MAX:
        definitions = definitions.filter(pk__in=model_ids)
        placements = placements.filter(model_id__in=model_ids)
    models = {m.pk: m for m in definitions if m.pk in model_ids}
    node_field = Placement._meta.get_field("node")
    pending: set[int] = set()
    for placement in placements.order_by("id"):
        model = models.get(placement.model_id)
        if model is None or model.pk in pending:
            continue
        node = nodes[placement.node_id]
        node_field.set_cached_value(placement, node)  # no query for the node (its error text)
        inst = _instance(statuses, node.node_id, placement.instance_id)
        if inst and lifecycle.restart_pending(model, placement, inst):
            pending.add(model.pk)
    return pending
