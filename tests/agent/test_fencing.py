"""Fencing on the agent: stale, competing and skewed masters are refused, and persisted."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from agent_support import RunningAgent, master_headers

from agent.state._fencing import Fencing


async def _stop(agent: RunningAgent, headers: dict[str, str]) -> tuple[int, dict]:
    async with agent.session.post(
        agent.url("/agent/v1/instances/nothing/stop"), headers=headers
    ) as resp:
        return resp.status, await resp.json()


async def test_higher_epoch_accepted_and_persisted(running_agent: RunningAgent) -> None:
    status, body = await _stop(running_agent, master_headers(epoch=5))
    assert status == 404 and body["error"]["code"] == "not_found"  # fenced, then carried out
    stored = json.loads((running_agent.server.config.state_directory / "fencing.json").read_text())
    assert stored == {"instanceId": "test-master", "epoch": 5, "bootId": "boot-1"}
    async with running_agent.session.get(running_agent.url("/agent/v1/info")) as resp:
        assert (await resp.json())["fencing"]["epoch"] == 5
    status, _ = await _stop(running_agent, master_headers(epoch=6, boot="boot-2"))
    assert status == 404


async def test_lower_epoch_is_stale_master(running_agent: RunningAgent) -> None:
    await _stop(running_agent, master_headers(epoch=5))
    for _ in range(20):  # every mutating call, not just the first
        status, body = await _stop(running_agent, master_headers(epoch=4))
        assert status == 409 and body["error"]["code"] == "stale_master"
    assert "below the accepted epoch 5" in body["error"]["message"]


async def test_same_epoch_other_boot_is_competing(running_agent: RunningAgent) -> None:
    await _stop(running_agent, master_headers(epoch=3))
    status, body = await _stop(running_agent, master_headers(epoch=3, boot="other-boot"))
    assert status == 409 and body["error"]["code"] == "competing_master"
    status, body = await _stop(running_agent, master_headers(epoch=3, instance="other-master"))
    assert status == 409 and body["error"]["code"] == "competing_master"


async def test_clock_skew_and_missing_headers(running_agent: RunningAgent) -> None:
    skewed = master_headers(epoch=1)
    skewed["MirbadLLM-Request-Time"] = (
        dt.datetime.now(dt.UTC) - dt.timedelta(minutes=6)
    ).isoformat()
    status, body = await _stop(running_agent, skewed)
    assert status == 400 and body["error"]["code"] == "clock_skew"
    async with running_agent.session.post(
        running_agent.url("/agent/v1/instances/x/stop"),
        headers={"MirbadLLM-Master": "", "MirbadLLM-Request-Time": ""},
    ) as resp:
        assert resp.status == 400
        assert "MirbadLLM-Master is required" in (await resp.json())["error"]["message"]
    bad = master_headers()
    bad["MirbadLLM-Master"] = "not a triple"
    status, body = await _stop(running_agent, bad)
    assert status == 400 and "is not {instance}/{epoch}/{boot}" in body["error"]["message"]


async def test_reads_need_no_fencing(running_agent: RunningAgent) -> None:
    async with running_agent.session.get(
        running_agent.url("/agent/v1/status"), headers={"MirbadLLM-Master": ""}
    ) as resp:
        assert resp.status == 200


def test_unreadable_fencing_file_refuses_to_guess(tmp_path) -> None:
    (tmp_path / "fencing.json").write_text("{broken")
    from agent._errors import StateUnavailable

    with pytest.raises(StateUnavailable, match="unreadable"):
        Fencing(state_dir=tmp_path)
