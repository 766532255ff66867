"""The operation log: written before the mutation, idempotent per id, closed after restarts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_support import RunningAgent, launch_body
from test_end_to_end import start_agent

from agent._config import AgentConfig, ExecutableEntry
from agent.state._oplog import OperationLog


async def _wait_state(agent: RunningAgent, instance_id: str, state: str) -> None:
    for _ in range(100):
        async with agent.session.get(agent.url("/agent/v1/instances")) as resp:
            found = {i["instanceId"]: i["state"] for i in (await resp.json())["instances"]}
        if found.get(instance_id) == state:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{instance_id} never reached {state}: {found}")


@pytest.mark.slow
async def test_same_operation_id_is_not_carried_out_twice(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
) -> None:
    running_agent = await start_agent(
        pki, state_dir, tmp_path, make_config(executables=(fake_engine,))
    )
    try:
        await _launch_stop_relaunch(running_agent)
    finally:
        await running_agent.session.close()
        await running_agent.server.stop()


async def _launch_stop_relaunch(running_agent: RunningAgent) -> None:
    body = launch_body()
    launch = {"MirbadLLM-Operation-Id": "op-launch-0001"}
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances"), json=body, headers=launch
    ) as resp:
        assert resp.status == 202, await resp.text()
        assert resp.headers["MirbadLLM-Operation-Id"] == "op-launch-0001"
    await _wait_state(running_agent, "m-1", "Ready")
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances/m-1/stop"),
        headers={"MirbadLLM-Operation-Id": "op-stop-0001"},
    ) as resp:
        assert resp.status == 200
    # The launch sent again with its id: the recorded answer, no second launch.
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances"), json=body, headers=launch
    ) as resp:
        assert resp.status == 202
        assert resp.headers.get("MirbadLLM-Operation-Repeated") == "true"
    await asyncio.sleep(0.5)
    await _wait_state(running_agent, "m-1", "Stopped")
    log = json.loads((running_agent.server.config.state_directory / "operations.json").read_text())
    states = {op["id"]: op["state"] for op in log["operations"]}
    assert states["op-launch-0001"] == "succeeded" and states["op-stop-0001"] == "succeeded"


async def test_refusals_are_recorded_and_bad_ids_refused(running_agent: RunningAgent) -> None:
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances/nope/stop"),
        headers={"MirbadLLM-Operation-Id": "op-stop-nope"},
    ) as resp:
        assert resp.status == 404
    op = running_agent.server.oplog.operations["op-stop-nope"]
    assert op["state"] == "failed" and op["status"] == 404
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances/nope/stop"),
        headers={"MirbadLLM-Operation-Id": "bad id!"},
    ) as resp:
        assert resp.status == 400
        assert "MirbadLLM-Operation-Id" in (await resp.json())["error"]["message"]
    # Without an id the agent draws one, so every mutation is logged.
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances/nope/stop")
    ) as resp:
        assert resp.headers["MirbadLLM-Operation-Id"].startswith("agent-")


async def test_open_operations_are_closed_from_the_files(tmp_path: Path) -> None:
    log = OperationLog(state_dir=tmp_path)
    await log.begin("op-a-000001", method="POST", path="/agent/v1/instances", instance_id="m-1")
    await log.begin("op-b-000001", method="POST", path="/agent/v1/instances", instance_id="m-2")
    await log.begin(
        "op-c-000001", method="POST", path="/agent/v1/instances/m-3/stop", instance_id=None
    )
    await log.begin(
        "op-d-000001", method="POST", path="/agent/v1/instances/m-1/stop", instance_id=None
    )
    # After a "restart": m-1 exists and runs, m-2 never got created, m-3 is stopped.
    reopened = OperationLog(state_dir=tmp_path)
    states = {"m-1": "Ready", "m-3": "Stopped"}
    assert reopened.reconcile(states.get) == 4
    result = {k: v["state"] for k, v in reopened.operations.items()}
    assert result == {
        "op-a-000001": "succeeded",  # the launch took effect
        "op-b-000001": "failed",  # it did not; nothing is replayed
        "op-c-000001": "succeeded",
        "op-d-000001": "failed",  # m-1 still runs: the stop did not happen
    }
    assert OperationLog(state_dir=tmp_path).reconcile(states.get) == 0


async def test_the_open_operations_are_listed_oldest_first_for_the_heartbeat(
    tmp_path: Path,
) -> None:
    log = OperationLog(state_dir=tmp_path)
    await log.begin("op-a-000001", method="POST", path="/agent/v1/instances", instance_id="m-1")
    await log.begin(
        "op-b-000001", method="POST", path="/agent/v1/instances/m-2/stop", instance_id=None
    )
    await log.close("op-a-000001", status=202, body=b"{}")
    assert log.open_operations() == [
        {
            "id": "op-b-000001",
            "kind": "stop",
            "instanceId": "m-2",
            "openedAt": log.operations["op-b-000001"]["openedAt"],
        }
    ]
    await log.close("op-b-000001", status=200, body=None)
    assert log.open_operations() == []


async def test_one_operation_is_read_back_and_an_unknown_one_is_404(
    running_agent: RunningAgent,
) -> None:
    """GET /agent/v1/operations/{id}: the record the master reconciles from, read-only."""
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances/nope/stop"),
        headers={"MirbadLLM-Operation-Id": "op-read-0001"},
    ) as resp:
        assert resp.status == 404
    async with running_agent.session.get(
        running_agent.url("/agent/v1/operations/op-read-0001")
    ) as resp:
        assert resp.status == 200
        record = await resp.json()
    assert record["id"] == "op-read-0001" and record["state"] == "failed"
    assert record["status"] == 404 and record["closedAt"] and record["kind"] == "stop"
    assert json.loads(record["body"])["error"]["code"] == "not_found"
    async with running_agent.session.get(
        running_agent.url("/agent/v1/operations/op-never-001")
    ) as resp:
        assert resp.status == 404
        assert resp.headers["x-mirbad-agent-error"] == "operation_unknown"
        error = (await resp.json())["error"]
    assert error["code"] == "operation_unknown"
    assert error["details"]["oldestOpenedAt"] == record["openedAt"]
    assert error["details"]["held"] == 1 and error["details"]["kept"] == 1000
    # Reading is not a mutation: nothing is recorded for it.
    assert set(running_agent.server.oplog.operations) == {"op-read-0001"}


async def test_a_repeat_of_a_running_operation_says_so_in_its_details(tmp_path: Path) -> None:
    from agent._errors import Conflict

    log = OperationLog(state_dir=tmp_path)
    await log.begin("op-run-00001", method="POST", path="/agent/v1/instances", instance_id="m-1")
    with pytest.raises(Conflict) as refused:
        await log.begin(
            "op-run-00001", method="POST", path="/agent/v1/instances", instance_id="m-1"
        )
    assert refused.value.details == {"operationId": "op-run-00001", "operationState": "open"}
