"""The agent's state files under a kill and a failing disk (issue 17, part 5).

- The operation log killed mid-save at each step of write_atomic loses at most the
  record being written, and loading + reconciling it twice gives the same state.
- A save whose fsync fails: a ``begin`` is refused and forgotten (the mutation never
  runs), a ``close`` keeps its answer; ``fencing.json`` keeps its old floor; over HTTP
  the agent logs the failure and answers 503 state_unavailable naming the file.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import RunningAgent, master_headers

from agent._errors import StateUnavailable
from agent.state._fencing import CompetingMaster, Fencing
from agent.state._oplog import OperationLog
from tests.crash_support import NEW_STEPS, STEPS, arm, in_killed_child

# (action, operation id, method, path, instance id or answer status)
SCRIPT: list[tuple[str, str, str, str, Any]] = [
    ("begin", "op-launch-m1", "POST", "/agent/v1/instances", "m-1"),
    ("close", "op-launch-m1", "", "", 202),
    ("begin", "op-launch-m2", "POST", "/agent/v1/instances", "m-2"),
    ("close", "op-launch-m2", "", "", 202),
    ("begin", "op-stop-m1000", "POST", "/agent/v1/instances/m-1/stop", None),
    ("close", "op-stop-m1000", "", "", 200),
    ("begin", "op-launch-m3", "POST", "/agent/v1/instances", "m-3"),
    ("begin", "op-stop-m2000", "POST", "/agent/v1/instances/m-2/stop", None),
]
# What the instance records show after the "restart": m-3 never got created.
WORLD = {"m-1": "Stopped", "m-2": "Ready"}


async def _play(log: OperationLog, action: tuple[str, str, str, str, Any]) -> None:
    kind, op_id, method, path, extra = action
    if kind == "begin":
        await log.begin(op_id, method=method, path=path, instance_id=extra)
    else:
        await log.close(op_id, status=extra, body=b"{}")


def _expected(count: int) -> dict[str, str]:
    """{id: state} after the first ``count`` actions of :data:`SCRIPT`."""
    states: dict[str, str] = {}
    for kind, op_id, _, _, extra in SCRIPT[:count]:
        states[op_id] = "open" if kind == "begin" else ("succeeded" if extra < 400 else "failed")
    return states


def _states(log: OperationLog) -> dict[str, str]:
    return {op_id: op["state"] for op_id, op in log.operations.items()}


def _outcome(log: OperationLog) -> dict[str, tuple[str, int | None, str | None]]:
    """Each operation's end as a replay decides it (not the times)."""
    return {k: (v["state"], v.get("status"), v.get("body")) for k, v in log.operations.items()}


def _kill_during_script(state_dir: Path, step: str, count: int) -> None:
    """A child plays ``count`` actions, then dies at ``step`` of the next one's save."""

    async def play() -> None:
        log = OperationLog(state_dir=state_dir)
        for action in SCRIPT[:count]:
            await _play(log, action)
        arm(step)
        await _play(log, SCRIPT[count])

    in_killed_child(lambda: asyncio.run(play()))


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_mid_save_loses_at_most_the_record_being_written(tmp_path: Path, step: str) -> None:
    for count in range(len(SCRIPT)):
        state_dir = tmp_path / f"k{count}"
        state_dir.mkdir(mode=0o700)
        _kill_during_script(state_dir, step, count)
        kept = count + 1 if step in NEW_STEPS else count
        assert _states(OperationLog(state_dir=state_dir)) == _expected(kept), (step, count)


@pytest.mark.parametrize("step", STEPS)
def test_replaying_the_log_twice_gives_the_same_state(tmp_path: Path, step: str) -> None:
    """After a kill: reconcile, restart, reconcile again: nothing changes the second time,
    and a kill during the first reconcile's save ends the same as no kill."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    _kill_during_script(state_dir, step, len(SCRIPT) - 1)  # two operations left open
    untouched = tmp_path / "copy"
    shutil.copytree(state_dir, untouched)

    first = OperationLog(state_dir=state_dir)
    closed = first.reconcile(WORLD.get)
    assert closed == (2 if step in NEW_STEPS else 1)
    on_disk = (state_dir / "operations.json").read_bytes()
    second = OperationLog(state_dir=state_dir)
    assert second.reconcile(WORLD.get) == 0
    assert _outcome(second) == _outcome(first)
    assert (state_dir / "operations.json").read_bytes() == on_disk  # nothing rewritten
    assert second.operations["op-launch-m3"]["state"] == "failed"  # never replayed

    # The restart itself killed while saving its reconcile: the next one ends the same.
    def reconcile_and_die() -> None:
        arm(step)
        OperationLog(state_dir=untouched).reconcile(WORLD.get)

    in_killed_child(reconcile_and_die)
    again = OperationLog(state_dir=untouched)
    again.reconcile(WORLD.get)
    assert _outcome(again) == _outcome(first)


def test_a_torn_log_is_refused_not_read_as_empty(tmp_path: Path) -> None:
    """write_atomic never leaves one; a file torn some other way (a copy cut short) must
    stop the agent rather than forget its open operations and run a repeat twice."""
    (tmp_path / "operations.json").write_text('{"operations": [{"id": "op-a-000001", "st')
    with pytest.raises(StateUnavailable, match=r"operations\.json is unreadable"):
        OperationLog(state_dir=tmp_path)


# -- a failing fsync --------------------------------------------------------------------


@pytest.fixture
def broken_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """``broken_disk(name)``: every fsync of a file whose path contains ``name`` fails
    with EIO (the temp file of ``name`` too); ``broken_disk("")`` mends it."""
    real = os.fsync
    failing = {"name": ""}

    def fsync(fd: Any) -> None:
        name = failing["name"]
        if name and name in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    def set_name(name: str) -> None:
        failing["name"] = name

    monkeypatch.setattr(os, "fsync", fsync)
    yield set_name


async def test_a_begin_that_cannot_be_saved_is_refused_and_forgotten(
    tmp_path: Path, broken_disk: Callable[[str], None]
) -> None:
    log = OperationLog(state_dir=tmp_path)
    await _play(log, SCRIPT[0])
    before = (tmp_path / "operations.json").read_bytes()
    broken_disk("operations.json")
    with pytest.raises(StateUnavailable) as refused:
        await _play(log, SCRIPT[2])
    assert "operations.json: fsync of the temp file failed (Input/output error)" in str(
        refused.value.message
    )
    assert "op-launch-m2" not in log.operations  # a retry must not find it open
    assert (tmp_path / "operations.json").read_bytes() == before
    broken_disk("")
    assert await log.begin(
        "op-launch-m2", method="POST", path="/agent/v1/instances", instance_id="m-2"
    ) is None  # fmt: skip


async def test_a_close_that_cannot_be_saved_keeps_its_answer(
    tmp_path: Path, broken_disk: Callable[[str], None], caplog: pytest.LogCaptureFixture
) -> None:
    log = OperationLog(state_dir=tmp_path)
    await _play(log, SCRIPT[0])
    broken_disk("operations.json")
    with caplog.at_level(logging.ERROR, "mirbad.agent.oplog"):
        await _play(log, SCRIPT[1])  # the launch ran: its answer is not turned into a 503
    assert "op-launch-m1 is closed but not saved" in caplog.text
    assert "operations.json: fsync of the temp file failed" in caplog.text
    assert log.operations["op-launch-m1"]["state"] == "succeeded"
    assert _states(OperationLog(state_dir=tmp_path)) == {"op-launch-m1": "open"}
    broken_disk("")
    await _play(log, SCRIPT[2])  # the next save carries it
    assert _states(OperationLog(state_dir=tmp_path)) == _expected(3)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


async def test_a_fencing_floor_that_cannot_be_saved_is_not_accepted(
    tmp_path: Path, broken_disk: Callable[[str], None]
) -> None:
    fencing = Fencing(state_dir=tmp_path)
    assert await fencing.check("m/1/b1", _now())
    broken_disk("fencing.json")
    with pytest.raises(StateUnavailable, match=r"fencing\.json: fsync of the temp file failed"):
        await fencing.check("m/2/b2", _now())
    assert fencing.accepted is not None and fencing.accepted.epoch == 1
    assert json.loads((tmp_path / "fencing.json").read_text())["epoch"] == 1
    broken_disk("")
    assert await fencing.check("m/2/b2", _now())


async def test_after_a_failed_directory_fsync_the_floor_is_what_the_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fencing = Fencing(state_dir=tmp_path)
    assert await fencing.check("m/1/b1", _now())
    real = os.fsync

    def fsync(fd: Any) -> None:
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StateUnavailable, match="may not survive a power loss"):
        await fencing.check("m/2/b2", _now())
    # The file holds epoch 2 (a restart would read it): the floor in memory too.
    assert fencing.accepted is not None and fencing.accepted.epoch == 2
    with pytest.raises(CompetingMaster):
        await fencing.check("other/2/b9", _now())  # not a new floor
    assert fencing.accepted.epoch == 2


@pytest.mark.parametrize("step", STEPS)
def test_a_fencing_floor_killed_mid_save_is_the_old_or_the_new(tmp_path: Path, step: str) -> None:
    Fencing(state_dir=tmp_path)  # none yet
    asyncio.run(Fencing(state_dir=tmp_path).check("m/1/b1", _now()))

    def raise_floor() -> None:
        arm(step)
        asyncio.run(Fencing(state_dir=tmp_path).check("m/2/b2", _now()))

    in_killed_child(raise_floor)
    accepted = Fencing(state_dir=tmp_path).accepted
    assert accepted is not None and accepted.epoch == (2 if step in NEW_STEPS else 1)


async def test_over_http_the_failure_is_logged_and_answered_with_the_file(
    running_agent: RunningAgent,
    broken_disk: Callable[[str], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = running_agent

    async def post(path: str, op_id: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        headers = {**master_headers(), "MirbadLLM-Operation-Id": op_id}
        async with agent.session.post(agent.url(path), json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    stop = "/agent/v1/instances/nope/stop"
    assert (await post(stop, "op-first-0001"))[0] == 404  # the floor and the log exist
    broken_disk("operations.json")
    with caplog.at_level(logging.ERROR):
        status, body = await post(stop, "op-broken-0001")
    assert status == 503 and body["error"]["code"] == "state_unavailable", body
    assert "operations.json: fsync of the temp file failed" in body["error"]["message"]
    assert f"POST {stop}: cannot write " in caplog.text
    # The rotation's record: its error reaches the middleware as AtomicWriteError.
    broken_disk("rotation.json")
    with caplog.at_level(logging.ERROR):
        status, body = await post(
            "/agent/v1/pki/rotations", "op-rotate-0001", {"rotationId": "r-0123456789abcdef"}
        )
    assert status == 503 and body["error"]["code"] == "state_unavailable", body
    assert "rotation.json: fsync of the temp file failed" in body["error"]["message"]
    assert "POST /agent/v1/pki/rotations: cannot write" in caplog.text
    assert agent.server.rotations.store.active is None  # memory went back to the file
    broken_disk("")
    assert (await post(stop, "op-broken-0001"))[0] == 404  # it ran this time
