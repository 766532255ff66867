"""The registry-wide restart-pending check (models_registry.listing.judge_registry, the
Overview's) memoizes each placement's expected fingerprint on what it depends on (issue
19). A memo keyed by less would show a stale answer: here every input is changed after
the memo was filled, through the services and behind their back (``QuerySet.update``,
as the admin, a shell or a migration may), and the answer must follow each time and
agree with the per-placement rule (lifecycle.restart_pending) it stands for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent.engines._spec import fingerprint, parse_launch_spec
from models_registry import lifecycle, listing, services
from models_registry.models import ModelDefinition, Placement
from nodes.models import Node
from tests.factories import make_node

VERSION = "0.6.0-dev"
GPUS = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"]


def _make(name: str, node: Node, **fields: Any) -> Placement:
    model = ModelDefinition.objects.create(
        served_name=name, source_folder="f", source_file="m.gguf", settings={}, **fields
    )
    return Placement.objects.create(
        model=model, node=node, gpu_uuids=GPUS, gpu_budgets=[2**30, 2**31]
    )


def _running(placement: Placement, version: str = VERSION) -> dict[str, Any]:
    """What the agent reports for a start of ``placement`` as it is defined now (the
    agent's own fingerprint formula, not the master's)."""
    spec = lifecycle.launch_spec(placement.model, placement)
    model = placement.model
    pinned = model.executable_version or version  # a start runs the pinned version
    reported = model.image if model.delivery == "container" else pinned
    return {
        "instanceId": placement.instance_id,
        "state": "Ready",
        "fingerprint": fingerprint(parse_launch_spec(spec), reported),
        "executable": {"name": "llama.cpp", "version": reported},
    }


class Fleet:
    """Two nodes' reported instances, and the check over the whole registry."""

    def __init__(self) -> None:
        self.statuses: dict[str, Any] = {}

    def report(self, placement: Placement, instance: dict[str, Any]) -> None:
        node = self.statuses.setdefault(placement.node.node_id, {"instances": {}})
        node["instances"][placement.instance_id] = instance

    def pending(self) -> set[int]:
        nodes = {n.pk: n for n in Node.objects.all()}
        registry = listing.judge_registry(nodes, self.statuses)
        assert registry.replicas == services.all_replicas()  # the same answer, one read
        return registry.pending

    def one_by_one(self) -> set[int]:
        """The per-placement rule on freshly loaded rows (no memo)."""
        found = set()
        for p in Placement.objects.select_related("model", "node"):
            inst = self.statuses.get(p.node.node_id, {})["instances"].get(p.instance_id)
            if lifecycle.restart_pending(p.model, p, inst):
                found.add(p.model_id)
        return found


def _settings_saved(p: Placement) -> None:
    services.update_model(p.model, {"settings": {"context_size": 8192}})


def _settings_behind(p: Placement) -> None:
    ModelDefinition.objects.filter(pk=p.model_id).update(settings={"parallel": 2})


def _settings_refused(p: Placement) -> None:  # saved before a rule was tightened
    ModelDefinition.objects.filter(pk=p.model_id).update(settings={"context_size": -1})


def _renamed(p: Placement) -> None:  # --alias changes
    ModelDefinition.objects.filter(pk=p.model_id).update(served_name="renamed")


def _version_pinned(p: Placement) -> None:
    ModelDefinition.objects.filter(pk=p.model_id).update(executable_version="0.5.0")


def _one_gpu(p: Placement) -> None:
    Placement.objects.filter(pk=p.pk).update(gpu_uuids=GPUS[:1])


def _budgets(p: Placement) -> None:  # --tensor-split changes
    Placement.objects.filter(pk=p.pk).update(gpu_budgets=[2**31, 2**30])


def _container(p: Placement) -> None:  # --host changes, the image is the version
    ModelDefinition.objects.filter(pk=p.model_id).update(delivery="container", image="e:1")


def _runtime(p: Placement) -> None:
    ModelDefinition.objects.filter(pk=p.model_id).update(runtime="vllm")


CHANGES: dict[str, Callable[[Placement], None]] = {
    "settings through the service": _settings_saved,
    "settings by QuerySet.update": _settings_behind,
    "settings now refused": _settings_refused,
    "served name": _renamed,
    "executable version pinned": _version_pinned,
    "GPUs of the placement": _one_gpu,
    "GPU budgets of the placement": _budgets,
    "delivery": _container,
    "runtime": _runtime,
}


@pytest.mark.django_db
@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_change_after_the_memo_was_filled_shows_restart_pending(change: str) -> None:
    n1, n2 = make_node("n1"), make_node("n2")
    changed, same = _make("changed", n1), _make("same", n2)
    fleet = Fleet()
    for p in (changed, same):
        fleet.report(p, _running(p))
    assert fleet.pending() == set() == fleet.one_by_one()
    assert fleet.pending() == set()  # the memo's answer, no longer computed

    CHANGES[change](changed)

    assert fleet.pending() == {changed.model_id} == fleet.one_by_one()
    if change == "settings now refused":
        return  # it cannot start again until its settings are changed
    # Started again with the new definition: no longer pending (the memo again).
    fleet.report(changed, _running(Placement.objects.select_related("model").get(pk=changed.pk)))
    assert fleet.pending() == set() == fleet.one_by_one()


@pytest.mark.django_db
def test_a_new_engine_version_on_the_node_shows_restart_pending() -> None:
    """Unpinned, the version the node runs is the expected one: the instance reporting
    another version with the old fingerprint is what runs no longer matching."""
    placement = _make("m", make_node("n1"))
    fleet = Fleet()
    fleet.report(placement, _running(placement))
    assert fleet.pending() == set()
    instance = {**_running(placement), "executable": {"name": "llama.cpp", "version": "0.7.0"}}
    fleet.report(placement, instance)
    assert fleet.pending() == {placement.model_id} == fleet.one_by_one()


@pytest.mark.django_db
@pytest.mark.parametrize("change", [{"image": "engine:2"}, {"delivery": "process"}])
def test_a_container_changed_shows_restart_pending(change: dict[str, str]) -> None:
    """The image is a container's version; back to a process, the image stays unused."""
    placement = _make("m", make_node("n1"), delivery="container", image="engine:1")
    fleet = Fleet()
    fleet.report(placement, _running(placement))
    assert fleet.pending() == set()
    ModelDefinition.objects.filter(pk=placement.model_id).update(**change)
    assert fleet.pending() == {placement.model_id} == fleet.one_by_one()


@pytest.mark.django_db
def test_the_memo_spares_the_second_render_and_stays_right_when_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = make_node("n1")
    placements = [_make(f"m{i}", node) for i in range(3)]
    fleet = Fleet()
    for p in placements:
        fleet.report(p, _running(p))
    computed: list[str] = []
    real = lifecycle.expected_fingerprint

    def counted(*args: Any) -> str | None:
        computed.append(args[0].served_name)
        return real(*args)

    monkeypatch.setattr(lifecycle, "expected_fingerprint", counted)
    listing._FINGERPRINTS.clear()
    assert fleet.pending() == set()
    assert sorted(computed) == ["m0", "m1", "m2"]
    assert fleet.pending() == set()
    assert len(computed) == 3  # every answer from the memo

    monkeypatch.setattr(listing, "FINGERPRINTS_MAX", 2)  # emptied when full, still right
    listing._FINGERPRINTS.clear()
    _settings_behind(placements[1])
    assert fleet.pending() == {placements[1].model_id} == fleet.one_by_one()
    assert len(listing._FINGERPRINTS) <= 2
