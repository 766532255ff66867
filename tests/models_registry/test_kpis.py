"""models_registry.kpis: the stalled and slow rules, and a model's series over replicas."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from models_registry import kpis
from nodes import stalls, telemetry
from nodes.stalls import InstancePoint
from tests.factories import make_model, make_node, set_status
from tests.telemetry_support import GIB, engine, history, sample

__all__ = ["history"]  # the fixture, imported to be used

NOW = 1_700_000_000.0


def _p(t: float, **values: Any) -> InstancePoint:
    base: dict[str, Any] = {
        "cpu": 100.0,
        "rss": GIB,
        "running": 1.0,
        "waiting": 0.0,
        "promptTps": 0.0,
        "genTps": 0.0,
        "kv": 0.3,
        "kvTokens": None,
        "prefixHit": None,
        "promptTotal": 10.0,
        "genTotal": 10.0,
    }
    base.update(values)
    return InstancePoint(t=t, **base)


def _window(
    seconds: float = 300, step: float = 5, newest_age: float = 0, **values: Any
) -> list[InstancePoint]:
    """Points every ``step`` s from ``seconds`` ago to ``newest_age`` s ago."""
    out, t = [], NOW - newest_age
    while t >= NOW - seconds:
        out.append(_p(t, **values))
        t -= step
    return out[::-1]


def test_running_without_tokens_or_kv_change_is_stalled() -> None:
    found = stalls.flags(_window(), NOW)
    assert found == {"stalled": True, "slow": False, "reason": stalls.STALLED_REASON}
    assert "stop and start the model" in found["reason"]


def test_kv_growth_is_progress_not_a_stall() -> None:
    points = _window()
    points[30]["kv"] = 0.31  # a prefill under way: vLLM counts its tokens at the end
    found = stalls.flags(points, NOW)
    assert not found["stalled"]
    assert found["slow"]  # still under 5 tokens/s generated for 5 minutes
    tokens = _window(kv=None, kvTokens=1000.0)
    assert stalls.flags(tokens, NOW)["stalled"]
    tokens[-1]["kvTokens"] = 1016.0
    assert not stalls.flags(tokens, NOW)["stalled"]


def test_unknown_kv_never_counts_as_unchanged() -> None:
    found = stalls.flags(_window(kv=None), NOW)
    assert not found["stalled"] and found["slow"]


def test_slow_under_five_generated_tokens_per_second() -> None:
    assert stalls.flags(_window(running=4.0, genTps=4.9, promptTps=300.0), NOW)["slow"]
    assert stalls.flags(_window(running=0.0, waiting=3.0, genTps=0.0, promptTps=0.0), NOW)["slow"]
    not_slow = stalls.flags(_window(running=4.0, genTps=5.0, promptTps=300.0), NOW)
    assert not_slow == stalls.CLEAR
    assert "Lower Max sequences" in stalls.SLOW_REASON


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda ps: ps[20].update(running=0.0, waiting=0.0), id="one idle sample"),
        pytest.param(lambda ps: ps[20].update(promptTps=None, genTps=None), id="no rates"),
        pytest.param(lambda ps: ps[-1].update(genTps=None), id="the newest without a rate"),
        pytest.param(lambda ps: ps[20].update(running=None, waiting=None), id="unknown load"),
        pytest.param(lambda ps: [ps.pop(20) for _ in range(6)], id="a 35 s gap"),
        pytest.param(lambda ps: [ps.pop(0) for _ in range(3)], id="4 min 45 s of samples"),
    ],
)
def test_what_clears_both_flags(spoil: Any) -> None:
    for points in (_window(), _window(running=3.0, genTps=1.0, promptTps=1.0, kv=None)):
        assert stalls.flags(points, NOW) != stalls.CLEAR  # flagged before the change
        spoil(points)
        assert stalls.flags(points, NOW) == stalls.CLEAR


def test_five_minutes_means_the_window_is_covered_and_current() -> None:
    assert stalls.flags(_window(seconds=290), NOW)["stalled"]  # oldest 290 s old: enough
    assert not stalls.flags(_window(seconds=285), NOW)["stalled"]
    assert stalls.flags(_window(step=5.1), NOW)["stalled"]  # the monitor's jitter
    assert stalls.flags(_window(newest_age=25), NOW)["stalled"]
    assert not stalls.flags(_window(newest_age=31), NOW)["stalled"]  # the samples stopped
    assert stalls.flags([], NOW) == stalls.CLEAR
    # Older samples before the window change nothing.
    assert stalls.flags([_p(NOW - 400, running=0.0), *_window()], NOW)["stalled"]


# -- over the registry -------------------------------------------------------------------


def _record(node_id: str, make: Any, seconds: float = 310, now: float = NOW) -> None:
    """Record a sample every 5 s over the last ``seconds``: ``make(i)`` builds sample i.

    Longer than the 5-minute window: the very first sample has no rates, and a window
    that starts on it is not "5 minutes of samples" of anything (docs/decisions.md D64).
    """

    async def run() -> None:
        count = int(seconds // 5) + 1
        for i in range(count):
            at = now - 5 * (count - 1 - i)
            await telemetry.arecord(node_id, make(i), now=at)
            await stalls.aupdate(node_id, at)  # as the monitor does after each sample

    asyncio.run(run())


def _ready(*instance_ids: str, state: str = "Ready") -> dict[str, dict[str, Any]]:
    return {i: {"instanceId": i, "state": state} for i in instance_ids}


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis", "history")
def test_model_flags_reads_each_node_once(django_assert_num_queries: Any) -> None:
    n1, n2 = make_node("n1"), make_node("n2")
    stalled, slow, idle, stopped = (make_model(n, n1) for n in ("stalled", "slow", "idle", "stop"))
    slow.placements.create(node=n2)  # a second replica, the slow one
    unplaced = make_model("unplaced")
    ids = {m.served_name: m.placements.first() for m in (stalled, slow, idle, stopped)}
    slow_on_n2 = slow.placements.get(node=n2).instance_id
    now = time.time()

    def n1_sample(i: int) -> dict[str, Any]:
        return sample(
            engine(ids["stalled"].instance_id, running=2, prompt=500, gen=500, kv=0.4),
            engine(ids["slow"].instance_id, running=0, waiting=0, prompt=i, gen=i),
            engine(ids["idle"].instance_id, running=0, waiting=0),
            engine(ids["stop"].instance_id, running=2, prompt=500, gen=500, kv=0.4),
        )

    _record("n1", n1_sample, now=now)
    _record("n2", lambda i: sample(engine(slow_on_n2, running=6, gen=10 * i, prompt=99 * i)),
            now=now)  # fmt: skip
    set_status(n1, instances={
        **_ready(*(ids[n].instance_id for n in ("stalled", "slow", "idle"))),
        **_ready(ids["stop"].instance_id, state="Stopped"),
    })  # fmt: skip
    set_status(n2, instances=_ready(slow_on_n2))

    models = [stalled, slow, idle, stopped, unplaced]
    with django_assert_num_queries(1):
        found = kpis.model_flags(models)
    assert found[stalled.pk]["stalled"] and not found[stalled.pk]["slow"]
    assert found[stalled.pk]["reason"].startswith("On n1: Requests running")
    assert found[slow.pk]["slow"] and not found[slow.pk]["stalled"]  # 2 tokens/s on n2
    assert found[slow.pk]["reason"].startswith("On n2: ")
    assert found[idle.pk] == stalls.CLEAR
    assert found[stopped.pk] == stalls.CLEAR  # stalled history, but not Ready
    assert found[unplaced.pk] == stalls.CLEAR


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis", "history")
def test_a_replica_on_an_offline_node_is_not_flagged() -> None:
    n1 = make_node("n1")
    model = make_model("m", n1)
    iid = model.placements.get().instance_id
    now = time.time()
    _record("n1", lambda i: sample(engine(iid, running=2, prompt=5, gen=5)), now=now)
    set_status(n1, state="Offline", instances=_ready(iid))
    assert kpis.model_flags([model])[model.pk] == stalls.CLEAR
    set_status(n1, instances=_ready(iid))
    assert kpis.model_flags([model])[model.pk]["stalled"]  # the same history, node Online


@pytest.mark.django_db
@pytest.mark.usefixtures("history")
def test_model_series_sums_its_replicas() -> None:
    n1, n2 = make_node("n1"), make_node("n2")
    model = make_model("m", n1)
    model.placements.create(node=n2)
    a, b = (p.instance_id for p in model.placements.order_by("id"))
    _record("n1", lambda i: sample(engine(a, running=1, waiting=2, gen=10 * i, prompt=100 * i,
                                          kv=0.2, prefix_hit=0.4, rss=GIB)), seconds=20)  # fmt: skip
    _record("n2", lambda i: sample(engine(b, running=3, waiting=None, gen=20 * i, prompt=None,
                                          kv=0.7, prefix_hit=0.8, rss=2 * GIB)), seconds=20,
            now=NOW + 1.5)  # fmt: skip
    points = kpis.model_series(model, "1h", now=NOW + 2)
    assert [p["t"] for p in points] == [NOW - 20 + 5 * i for i in range(5)]
    first, last = points[0], points[-1]
    assert first["genTps"] is None and first["promptTps"] is None  # no rates yet anywhere
    assert last == {
        "t": NOW,
        "memory": 3 * GIB,
        "running": 4.0,
        "waiting": 2.0,  # only a reports waiting
        "promptTps": 20.0,  # only a reports prompt tokens
        "genTps": 2.0 + 4.0,
        "kv": 0.7,
        "prefixHit": pytest.approx(0.6),
    }
    coarse = kpis.model_series(model, "24h", now=NOW + 2)
    assert coarse and coarse[-1]["memory"] == 3 * GIB
    assert kpis.model_series(make_model("alone"), "1h") == []


@pytest.mark.django_db
@pytest.mark.usefixtures("history")
def test_latest_many_sums_each_models_replicas_from_current_points_only() -> None:
    n1, n2 = make_node("n1"), make_node("n2")
    model = make_model("m", n1)
    model.placements.create(node=n2)
    a, b = (p.instance_id for p in model.placements.order_by("id"))
    other = make_model("o", n2)
    c = other.placements.get().instance_id
    _record(
        "n1", lambda i: sample(engine(a, running=1, waiting=2, gen=10 * i, rss=GIB)), seconds=20
    )
    _record("n2", lambda i: sample(engine(b, running=3, waiting=None, rss=2 * GIB),
                                   engine(c, running=5, rss=GIB)), seconds=20)  # fmt: skip
    latest = kpis.latest_many([model, other, make_model("idle")], now=NOW + 2)
    assert set(latest) == {model.pk, other.pk}  # the idle model reports nothing
    assert latest[model.pk]["running"] == 4.0 and latest[model.pk]["waiting"] == 2.0
    assert latest[model.pk]["memory"] == 3 * GIB and latest[other.pk]["running"] == 5.0
    # Two minutes later nothing is current: a stale point is never shown as now.
    assert kpis.latest_many([model, other], now=NOW + 120) == {}
