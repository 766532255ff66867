"""``./mirbad test``'s choice of pytest runs (mirbad_site/devtools.py) and what each
xdist worker owns (tests/parallel.py): the two are what keeps a parallel run from
colliding with itself."""

from __future__ import annotations

import pytest

from mirbad_site import devtools
from tests import parallel


@pytest.fixture(autouse=True)
def _default_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIRBAD_TEST_WORKERS", raising=False)
    monkeypatch.delenv("MIRBAD_TEST_SLOW_WORKERS", raising=False)


def _workers(pytest_args: list[str]) -> str | None:
    return pytest_args[pytest_args.index("-n") + 1] if "-n" in pytest_args else None


def test_the_whole_suite_is_the_quick_lane_then_the_slow_lane() -> None:
    runs = devtools.lanes(["--durations=40"])
    assert [args[args.index("-m") + 1] for _, args in runs] == ["not slow", "slow"]
    assert [_workers(args) for _, args in runs] == [
        str(devtools.DEFAULT_WORKERS),
        str(devtools.DEFAULT_SLOW_WORKERS),
    ]
    assert all(args[-1] == "--durations=40" for _, args in runs)


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "not slow"],
        ["tests/e2e/test_up.py"],
        ["-k", "queue"],
        ["-n", "0"],
        ["-n0"],
        ["--lf"],
    ],
)
def test_a_choice_of_tests_or_workers_is_one_run(args: list[str]) -> None:
    runs = devtools.lanes(args)
    assert len(runs) == 1
    assert runs[0][1][-len(args) :] == args


def test_a_chosen_worker_count_is_left_alone() -> None:
    ((_, run_args),) = devtools.lanes(["-n", "0"])
    assert run_args == ["-n", "0"]
    ((_, run_args),) = devtools.lanes(["-n2", "--dist", "loadfile"])
    assert run_args == ["-n2", "--dist", "loadfile"]


def test_the_worker_counts_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRBAD_TEST_WORKERS", "0")
    monkeypatch.setenv("MIRBAD_TEST_SLOW_WORKERS", "5")
    quick, slow = devtools.lanes([])
    assert _workers(quick[1]) is None
    assert _workers(slow[1]) == "5"


def test_a_worker_count_that_is_not_a_number_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MIRBAD_TEST_SLOW_WORKERS", "two")
    with pytest.raises(SystemExit, match="MIRBAD_TEST_SLOW_WORKERS='two'"):
        devtools.lanes([])


def test_each_worker_has_its_own_redis_databases_and_port_block() -> None:
    redis = "redis://127.0.0.1:6379/0"
    suite = {parallel._with_db(redis, parallel.FIRST_DB + 2 * k) for k in range(6)}
    stacks = {parallel._with_db(redis, parallel.FIRST_DB + 2 * k + 1) for k in range(6)}
    assert len(suite | stacks) == 12
    assert parallel.FIRST_DB + 2 * parallel.MAX_WORKERS <= 16, "Redis keeps 16 databases"
    assert parallel._with_db("unix:///run/r.sock?db=2&x=1", 7) == "unix:///run/r.sock?x=1&db=7"


def test_free_port_never_hands_out_a_port_twice_and_stays_in_its_block() -> None:
    ports = [parallel.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p in parallel._block for p in ports)
    assert parallel._block.stop <= 32_768, "below the kernel's ephemeral ports"
