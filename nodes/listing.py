"""Which nodes a list shows: the filters and the page of ``GET /api/nodes``, the console's
Nodes page and the Overview's fleet table, one rule for all three.

Filters (every one optional, all of them must match):

- ``state``: effective states (``nodes.status.effective``), repeatable or a comma list;
- ``model``: nodes holding a replica of this model (its served name, or its id);
- ``search``: a case-insensitive substring of the id, name, address, OS, architecture
  or a reason code;
- ``show`` (the console's chips): ``attention``, ``pending``, ``draining``, ``maintenance``.

The registry is read once for the candidates (a few columns), the status cache once for
them only when a filter needs a node's state (one ``read_many`` round trip, never one per
node), and the page's nodes are then loaded whole with their open rotation: the cost of a
page does not grow with the fleet past those two reads (docs/decisions.md (Lists of a
thousand nodes: all rows up to a cap)). :func:`select` loads them as Node instances (the
console), :func:`select_values` as :class:`NodeValues` (``GET /api/nodes``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar, cast

from django.db.models import Prefetch, Q, QuerySet

from core import paging
from nodes import labels as node_labels
from nodes import status as node_status
from nodes.models import CertRotation, Node
from nodes.states import NodeState
from nodes.status_cache import NodeStatus

STATES = tuple(s.value for s in NodeState)
# A page of more nodes than this is loaded without an IN list of their ids.
IN_MAX = 500
SHOW = ("all", "attention", "pending", "draining", "maintenance")
# What the filters read of every candidate; the page's rows are loaded whole afterwards.
_FILTER_FIELDS = (
    "node_id",
    "display_name",
    "address",
    "os",
    "arch",
    "approved",
    "revoked",
    "draining",
    "maintenance_until",
    "labels",
)


@dataclass(frozen=True, slots=True)
class NodeFilter:
    """What a reader asked for; the defaults match every node."""

    states: frozenset[str] = frozenset()
    model: str = ""
    search: str = ""
    show: str = "all"
    labels: tuple[node_labels.Selector, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.states or self.model or self.search or self.labels or self.show != "all")

    @property
    def needs_status(self) -> bool:
        return bool(self.states or self.search or self.show == "attention")


@dataclass(slots=True)
class NodeValues:
    """A node row as plain values: the columns ``GET /api/nodes`` answers with, and the
    Node methods it calls, which are the model's own (they read only these columns).

    A Node instance costs about 7 µs to build (``Model.from_db``): the list's thousand rows
    took 13 ms as Nodes and 5.5 ms as values (SQLite, issue 19).
    """

    pk: int
    node_id: str
    display_name: str
    address: str
    is_bootstrap: bool
    approved: bool
    revoked: bool
    draining: bool
    maintenance_until: datetime.datetime | None
    maintenance_reason: str
    spki_pin: str
    pending_pin: str
    cert_not_after: datetime.datetime | None
    agent_version: str
    os: str
    arch: str
    memory_total_bytes: int | None
    facts: Any
    memory_reserve_bytes: int
    gpu_reserves: Any
    labels: Any
    open_rotations: list[CertRotation] = field(default_factory=list)

    @property
    def enrolled(self) -> bool:
        return bool(Node.enrolled.fget(cast(Node, self)))  # type: ignore[attr-defined]  # a property

    def maintenance_left(self, now: datetime.datetime | None = None) -> float:
        return Node.maintenance_left(cast(Node, self), now)

    def gpu_reserve(self, uuid: str) -> int:
        return Node.gpu_reserve(cast(Node, self), uuid)


_VALUE_COLUMNS = tuple(f.name for f in fields(NodeValues) if f.name != "open_rotations")


def node_values(rows: QuerySet[Node]) -> list[NodeValues]:
    """``rows`` as :class:`NodeValues`, in their order (one query, no Node built)."""
    return [NodeValues(*row) for row in rows.values_list(*_VALUE_COLUMNS)]


Row = TypeVar("Row", Node, NodeValues)


@dataclass(slots=True)
class NodePage(Generic[Row]):
    """The page's nodes (with ``open_rotations``), statuses of at least those, and counts."""

    nodes: list[Row]
    statuses: dict[str, NodeStatus]
    count: int  # nodes matching the filter
    total: int  # nodes in the registry


def parse_filter(params: Any, *, search_name: str = "search") -> NodeFilter:
    """``state``, ``model``, ``search`` (the console calls it ``q``, with ``show``) and
    ``label`` from query parameters; a bad value is a 400 naming the parameter
    (core.paging)."""
    return NodeFilter(
        states=paging.choices(params, "state", STATES),
        model=paging.text(params, "model"),
        search=paging.text(params, search_name, most=100),
        labels=node_labels.parse_selectors(params),
    )


def open_rotations() -> Prefetch:
    return Prefetch(
        "rotations", queryset=CertRotation.objects.filter(open=True), to_attr="open_rotations"
    )


def attach_open_rotations(nodes: Sequence[Node | NodeValues]) -> None:
    """Each node's ``open_rotations`` as :func:`open_rotations` leaves it, from one query
    over the open rotations (a handful at any time), whatever the count of nodes."""
    opened: dict[int, list[CertRotation]] = {}
    for found in CertRotation.objects.filter(open=True):
        opened.setdefault(found.node_id, []).append(found)
    for node in nodes:
        # The attribute Prefetch(to_attr="open_rotations") sets; not a field of Node.
        node.open_rotations = opened.get(node.pk, [])  # type: ignore[union-attr]


def _model_q(model: str) -> Q:
    wanted = Q(placements__model__served_name=model)
    if model.isdigit() and len(model) < 19:
        wanted |= Q(placements__model_id=int(model))
    return wanted


def _searched(node: Node, status: NodeStatus | None, needle: str) -> bool:
    fields = [node.node_id, node.display_name, node.address, node.os, node.arch]
    fields += [str(r.get("code", "")) for r in (status or {}).get("reasons") or []]
    return any(needle in value.lower() for value in fields if value)


def matches(node: Node, status: NodeStatus | None, wanted: NodeFilter) -> bool:
    """Whether ``node`` (with its effective ``status`` when the filter needs it) is listed."""
    state = node_status.state_of(status)
    if wanted.states and state not in wanted.states:
        return False
    if wanted.search and not _searched(node, status, wanted.search.lower()):
        return False
    if wanted.labels and not node_labels.matches(node.labels, wanted.labels):
        return False
    if wanted.show == "attention":
        # Offline, Degraded, blocked, waiting for approval: anything but Online.
        return not node.revoked and state != NodeState.ONLINE.value
    if wanted.show == "pending":
        return not node.approved and not node.revoked
    if wanted.show == "draining":
        return node.draining
    if wanted.show == "maintenance":
        return node.maintenance_left() > 0
    return True


def _unfiltered(
    window: paging.Window, load: Callable[[QuerySet[Node]], list[Row]]
) -> NodePage[Row]:
    """Every node, paged in the database: the page's rows are read once, whole.

    Without a filter there is nothing to decide on light rows first: reading every row
    light and then the page's rows again, whole, doubled the database work of
    ``GET /api/nodes`` at 1,000 nodes (issue 19).
    """
    total = Node.objects.count()
    nodes = load(Node.objects.order_by("node_id")[window.offset : window.offset + window.limit])
    attach_open_rotations(nodes)
    statuses = node_status.read_many(nodes) if nodes else {}
    return NodePage(nodes=nodes, statuses=statuses, count=total, total=total)


def select(wanted: NodeFilter, window: paging.Window) -> NodePage[Node]:
    """The nodes matching ``wanted``, ordered by id, cut to ``window``, as Node instances.

    Queries: the candidates (a few columns), the total when a filter narrowed them in the
    database, the page's rows and the open rotations; one Redis round trip: every
    candidate's status when the filter needs it, else the page's. Without a filter: the
    count, the page's rows and the open rotations.
    """
    return _select(wanted, window, list)


def select_values(wanted: NodeFilter, window: paging.Window) -> NodePage[NodeValues]:
    """:func:`select` with the page's nodes as :class:`NodeValues` (the same queries)."""
    return _select(wanted, window, node_values)


def _select(
    wanted: NodeFilter, window: paging.Window, load: Callable[[QuerySet[Node]], list[Row]]
) -> NodePage[Row]:
    if not wanted.active:
        return _unfiltered(window, load)
    candidates = Node.objects.only(*_FILTER_FIELDS).order_by("node_id")
    if wanted.model:
        candidates = candidates.filter(_model_q(wanted.model)).distinct()
    found = list(candidates)
    total = Node.objects.count() if wanted.model else len(found)
    statuses: dict[str, NodeStatus] = {}
    read_all = wanted.needs_status
    if read_all:
        statuses = node_status.read_many(found)
    if wanted.active:
        found = [n for n in found if matches(n, statuses.get(n.node_id), wanted)]
    shown = window.cut(found)
    if len(shown) <= IN_MAX:
        nodes = load(Node.objects.filter(node_id__in=[n.node_id for n in shown]))
    else:  # every node: no IN of thousands of ids (SQLite refuses one)
        wanted_ids = {n.node_id for n in shown}
        nodes = [n for n in load(Node.objects.all()) if n.node_id in wanted_ids]
    nodes.sort(key=lambda n: n.node_id)
    attach_open_rotations(nodes)
    if not read_all:
        statuses = node_status.read_many(nodes) if nodes else {}
    return NodePage(nodes=nodes, statuses=statuses, count=len(found), total=total)
