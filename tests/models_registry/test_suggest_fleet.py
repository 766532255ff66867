"""Placement suggestions over many nodes (issue 19): a fixed number of queries whatever
the count of nodes, GPUs and Starting instances, and the same ranking as before."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from models_registry.models import ModelDefinition
from nodes import status_cache
from tests.factories import make_model, make_node, set_status

pytestmark = pytest.mark.django_db

GIB = 2**30


def _gpu(node_id: str, index: int, used: int) -> dict[str, object]:
    return {
        "index": index,
        "uuid": f"GPU-{node_id}-{index}",
        "memoryTotalBytes": 80 * GIB,
        "memoryUsedBytes": used * GIB,
    }


def _fleet(first: int, last: int, starting_model: ModelDefinition) -> None:
    """Nodes first..last-1, Online, four GPUs each; on each a Starting instance of
    ``starting_model`` on its GPU 0 (a burst of starts across the fleet)."""
    for i in range(first, last):
        node = make_node(f"n{i:02d}")
        instance = {
            "instanceId": f"i-{i}",
            "modelId": starting_model.pk,
            "state": "Starting",
            "gpuUuids": [f"GPU-{node.node_id}-0"],
        }
        set_status(node, "Online", {instance["instanceId"]: instance})
        status = status_cache.read(node.node_id) or {}
        status["telemetry"]["gpus"] = [_gpu(node.node_id, g, 10 * g) for g in range(4)]  # type: ignore[index]
        status_cache.write(status)


def _suggest(client: APIClient, model: ModelDefinition) -> tuple[int, list[dict[str, object]]]:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(f"/api/models/{model.pk}/placement-suggestions")
    assert response.status_code == 200, response.content
    return len(captured.captured_queries), response.json()["suggestions"]


def test_queries_do_not_grow_with_nodes_gpus_or_starting_instances(
    operator_client: APIClient, status_redis: object
) -> None:
    starting = make_model("starting")
    starting.memory_budget_bytes = 60 * GIB
    starting.save()
    model = make_model("m")
    model.memory_budget_bytes = 30 * GIB
    model.save()
    _fleet(0, 2, starting)
    _suggest(operator_client, model)  # warm: per-process caches
    few, _ = _suggest(operator_client, model)
    _fleet(2, 12, starting)
    many, ranked = _suggest(operator_client, model)
    # Before issue 19: one query per GPU of each node per Starting instance on it.
    assert many == few
    assert len(ranked) == 12
    # GPU 0 holds 60 GiB Starting beside its 0 used: 80 - 1 reserve - 60 = 19 GiB free;
    # GPU 1 has 80 - 10 - 1 = 69 GiB free, the roomiest, so it is the one suggested.
    first = ranked[0]
    assert first["fits"] is True and first["gpuUuids"] == ["GPU-n00-1"]
    assert first["reasons"] == [
        "GPU 1: needs 30.0 GiB, 69.0 GiB free after the 1.0 GiB reserve - fits"
    ]


def test_a_starting_instance_counts_against_its_gpu(
    operator_client: APIClient, status_redis: object
) -> None:
    """The Starting budget is taken off the GPU it was placed on (lifecycle's rule): the
    empty GPU 0 is not the roomiest while 75 GiB are starting on it."""
    starting = make_model("starting")
    starting.memory_budget_bytes = 75 * GIB
    starting.save()
    model = make_model("m")
    model.memory_budget_bytes = 30 * GIB
    model.save()
    _fleet(0, 1, starting)
    status = status_cache.read("n00") or {}
    status["telemetry"]["gpus"] = [_gpu("n00", 0, 0), _gpu("n00", 1, 20)]  # type: ignore[index]
    status_cache.write(status)
    _, ranked = _suggest(operator_client, model)
    assert ranked[0]["fits"] is True and ranked[0]["gpuUuids"] == ["GPU-n00-1"]
    assert ranked[0]["reasons"] == [
        "GPU 1: needs 30.0 GiB, 59.0 GiB free after the 1.0 GiB reserve - fits"
    ]


@pytest.mark.parametrize(
    "gpus",
    [
        [(80, 10), (80, 10), (80, 70)],  # a tie: the first
        [(80, 79), (80, 80), (None, 0)],  # 0 free, a negative, no sizes
        [(80, 90), (None, None)],  # over-full beside unknown
        [(24, 0), (80, 0), (48, 0)],
    ],
)
def test_the_roomiest_gpu_is_the_one_every_gpu_s_line_would_rank_first(
    gpus: list[tuple[int | None, int | None]],
) -> None:
    """One admission check per node gives the line that checking every GPU and keeping
    the most free (`line.free or -1`, the first on a tie) gave before issue 19."""
    from models_registry import admission, suggest

    node = make_node("n", gpu_reserves={"GPU-1": 0})
    probe = [
        {
            "index": i,
            "uuid": f"GPU-{i}",
            "memoryTotalBytes": None if total is None else total * GIB,
            "memoryUsedBytes": None if used is None else used * GIB,
        }
        for i, (total, used) in enumerate(gpus)
    ]
    status = {"telemetry": {"gpus": probe}}
    starting: dict[str | None, int] = {"GPU-2": GIB}
    best = None
    for uuid in admission.node_gpus(node, status):
        line = admission.check(
            node=node, gpu_uuids=[uuid], gpu_budgets=[], budget=8 * GIB, status=status,
            starting_budgets=starting,
        )[0]  # fmt: skip
        if best is None or (line.free or -1) > (best.free or -1):
            best = line
    assert best is not None
    fits, uuids, text = suggest._budget_line(node, status, 8 * GIB, starting)
    assert (fits, uuids, text) == (best.fits, [best.uuid] if best.fits else [], best.text())
