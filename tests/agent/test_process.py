"""The process runtime with a fake engine: Ready, failures, stop, restarts, adoption."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from agent_support import launch_body, start_runtime

import agent.engines.process._adoption
from agent import Conflict
from agent._config import AgentConfig, ExecutableEntry
from agent.engines._executables import Catalogue, write_manifest
from agent.engines.process._handle import AdoptedProcess, EngineProcess
from agent.engines.process._runtime import ProcessRuntime
from agent.state._events import EventBus
from tests.parallel import engine_port_range

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

Factory = Callable[..., "asyncio.Future[ProcessRuntime]"]


@pytest.fixture
async def runtime_factory(
    make_config: Callable[..., AgentConfig], fake_engine: ExecutableEntry
) -> AsyncIterator[Callable[..., Any]]:
    made: list[ProcessRuntime] = []

    async def build(**overrides: Any) -> ProcessRuntime:
        runtime = await start_runtime(make_config(executables=(fake_engine,), **overrides))
        made.append(runtime)
        return runtime

    yield build
    for runtime in made:
        await runtime.close()


async def wait_state(runtime: ProcessRuntime, instance_id: str, *states: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        inst = runtime.get(instance_id).to_json()
        if inst["state"] in states:
            return inst
        await asyncio.sleep(0.05)
    raise AssertionError(f"{instance_id} never reached {states}: {inst}")


async def engine_get(runtime: ProcessRuntime, instance_id: str, path: str) -> int:
    inst = runtime.get(instance_id)
    headers = {"Authorization": f"Bearer {inst.key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{inst.port}{path}", headers=headers) as resp,
    ):
        return resp.status


async def crash(runtime: ProcessRuntime, instance_id: str) -> None:
    with contextlib.suppress(aiohttp.ClientError):
        await engine_get(runtime, instance_id, "/crash")


async def test_ready_and_secrets_stay_out_of_argv(runtime_factory: Any, state_dir: Path) -> None:
    runtime = await runtime_factory()
    bus: EventBus = runtime._bus
    with bus.subscribe() as events:
        first = await runtime.launch(launch_body(env={"OMP_NUM_THREADS": "1"}))
        assert first["state"] == "Starting" and first["port"] is not None
        ready = await wait_state(runtime, "m-1", "Ready")
        states = [(await events.get()).data["state"] for _ in range(2)]  # type: ignore[union-attr]  # None only once unsubscribed
    assert states == ["Starting", "Ready"]
    low, high = engine_port_range()
    assert low <= ready["port"] <= high
    assert ready["pid"] and ready["readyAt"] and ready["fingerprint"].startswith("sha256:")
    assert "apiKey" not in ready
    key = runtime.get("m-1").key
    proc = psutil.Process(ready["pid"])
    assert key not in " ".join(proc.cmdline())
    environ = proc.environ()
    assert environ["LLAMA_API_KEY"] == key and environ["OMP_NUM_THREADS"] == "1"
    assert set(environ) <= {"PATH", "HOME", "LANG", "LLAMA_API_KEY", "OMP_NUM_THREADS", "LC_CTYPE"}
    assert proc.pid == __import__("os").getpgid(proc.pid), "engine must lead its own group"
    record_file = state_dir / "processes.json"
    assert stat.S_IMODE(record_file.stat().st_mode) == 0o600
    record = json.loads(record_file.read_text())["instances"][0]
    assert record["apiKey"] == key and record["state"] == "Ready"
    log_text = (state_dir / "logs" / "ss-m-1.log").read_text()
    assert "fake engine: listening" in log_text and key not in log_text
    # Only the key opens the engine.
    assert await engine_get(runtime, "m-1", "/v1/models") == 200


async def test_exit_before_ready_is_failed_with_log_tail(runtime_factory: Any) -> None:
    runtime = await runtime_factory()
    await runtime.launch(launch_body(env={"FAKE_MODE": "exit_early"}))
    failed = await wait_state(runtime, "m-1", "Failed")
    assert failed["exitCode"] == 3
    assert failed["error"] == "llama-server exited with code 3 before it was ready"
    assert failed["logTail"][-1] == "error: the model file is broken"
    assert failed["pid"] is None


async def test_stop_kills_the_process_group(runtime_factory: Any, tmp_path: Path) -> None:
    runtime = await runtime_factory()
    pid_file = tmp_path / "child.pid"
    env = {"FAKE_MODE": "child", "FAKE_CHILD_PID_FILE": str(pid_file)}
    await runtime.launch(launch_body(env=env))
    ready = await wait_state(runtime, "m-1", "Ready")
    child = psutil.Process(int(pid_file.read_text()))
    assert child.is_running()
    stopped = await runtime.stop("m-1")
    assert stopped["state"] == "Stopped" and stopped["pid"] is None
    assert not psutil.pid_exists(ready["pid"]) or (
        psutil.Process(ready["pid"]).status() == psutil.STATUS_ZOMBIE
    )
    await asyncio.sleep(0.1)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    again = await runtime.stop("m-1")
    assert again["state"] == "Stopped"


async def test_stop_escalates_to_sigkill(runtime_factory: Any) -> None:
    runtime = await runtime_factory()
    await runtime.launch(launch_body(env={"FAKE_MODE": "ignore_term"}))
    await wait_state(runtime, "m-1", "Ready")
    started = time.monotonic()
    stopped = await runtime.stop("m-1")
    assert stopped["exitCode"] == -9
    assert 0.9 <= time.monotonic() - started < 5


async def test_restart_after_ready_within_budget(runtime_factory: Any) -> None:
    runtime = await runtime_factory(restart_budget=1)
    await runtime.launch(launch_body())
    ready = await wait_state(runtime, "m-1", "Ready")
    await crash(runtime, "m-1")
    await asyncio.sleep(0.3)
    again = await wait_state(runtime, "m-1", "Ready")
    assert again["restartCount"] == 1
    assert again["port"] == ready["port"] and again["pid"] != ready["pid"]
    await crash(runtime, "m-1")
    failed = await wait_state(runtime, "m-1", "Failed")
    assert failed["exitCode"] == 7
    assert "after it was ready" in failed["error"] and "restarted 1 times" in failed["error"]


@pytest.mark.parametrize("mode", ["never_ready", "wrong_alias"])
async def test_start_timeout_kills_and_fails(runtime_factory: Any, mode: str) -> None:
    runtime = await runtime_factory(process_start_timeout_seconds=1.0)
    await runtime.launch(launch_body(env={"FAKE_MODE": mode}))
    starting = runtime.get("m-1").to_json()
    failed = await wait_state(runtime, "m-1", "Failed")
    assert "not ready after 1 s" in failed["error"]
    assert not psutil.pid_exists(starting["pid"]) or (
        psutil.Process(starting["pid"]).status() == psutil.STATUS_ZOMBIE
    )


async def test_relaunch_rules_and_delete(runtime_factory: Any, state_dir: Path) -> None:
    runtime = await runtime_factory()
    first = await runtime.launch(launch_body())
    same = await runtime.launch(launch_body())
    assert same["pid"] == first["pid"]
    with pytest.raises(Conflict):
        await runtime.launch(launch_body(servedName="other"))
    await runtime.stop("m-1")
    other = await runtime.launch(launch_body(servedName="other"))
    assert other["servedName"] == "other" and other["state"] == "Starting"
    await runtime.delete("m-1")
    assert runtime.list() == []
    assert json.loads((state_dir / "processes.json").read_text())["instances"] == []


async def test_two_launches_get_different_ports(runtime_factory: Any) -> None:
    runtime = await runtime_factory()
    a, b = await asyncio.gather(runtime.launch(launch_body("a")), runtime.launch(launch_body("b")))
    assert a["port"] != b["port"]
    await wait_state(runtime, "a", "Ready")
    await wait_state(runtime, "b", "Ready")


async def left_running(runtime_factory: Any) -> dict[str, Any]:
    """A first runtime starts m-1 and goes away leaving it running (as if killed)."""
    crashed = await runtime_factory()
    await crashed.launch(launch_body())
    ready = await wait_state(crashed, "m-1", "Ready")
    await crashed.close(stop_instances=False)
    assert psutil.Process(ready["pid"]).is_running()
    return {**ready, "key": crashed.get("m-1").key}


async def wait_new_pid(runtime: ProcessRuntime, old_pid: int) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        inst = runtime.get("m-1").to_json()
        if inst["state"] == "Ready" and inst["pid"] != old_pid:
            return inst
        if inst["state"] == "Failed":
            raise AssertionError(inst)
        await asyncio.sleep(0.05)
    raise AssertionError(f"m-1 was not restarted: {inst}")


async def test_adopted_engine_restarts_within_budget(
    runtime_factory: Any, state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ready = await left_running(runtime_factory)
    caplog.set_level(logging.INFO, logger="mirbad.agent")
    # A second runtime on the same state directory plays the restarted agent.
    restarted = await runtime_factory(restart_budget=1)
    inst = restarted.get("m-1")
    assert inst.to_json()["state"] in ("Starting", "Ready")
    assert isinstance(inst.proc, AdoptedProcess) and inst.proc.watched_by_pidfd
    adopted = await wait_state(restarted, "m-1", "Ready")
    assert adopted["pid"] == ready["pid"] and adopted["port"] == ready["port"]
    assert inst.key == ready["key"]
    assert f"Adopted instance m-1 (pid {ready['pid']}, port {ready['port']})" in caplog.text
    assert "Reconciled: adopted 1, gone 0, orphans stopped 0" in caplog.text
    assert await engine_get(restarted, "m-1", "/v1/models") == 200
    record = json.loads((state_dir / "processes.json").read_text())["instances"][0]
    assert record["pid"] == ready["pid"] and record["state"] == "Ready"
    # Its exit after Ready follows the usual rule: a new child on the same port ...
    await crash(restarted, "m-1")
    again = await wait_new_pid(restarted, ready["pid"])
    assert again["port"] == ready["port"] and again["restartCount"] == 1
    assert isinstance(restarted.get("m-1").proc, EngineProcess)
    # ... until the budget is spent.
    await crash(restarted, "m-1")
    failed = await wait_state(restarted, "m-1", "Failed")
    assert "restarted 1 times" in failed["error"]


async def test_adopted_engine_exit_seen_by_polling(
    runtime_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = await left_running(runtime_factory)
    monkeypatch.setattr(agent.engines.process._adoption, "open_pidfd", lambda pid: None)
    restarted = await runtime_factory(restart_budget=0)
    inst = restarted.get("m-1")
    assert isinstance(inst.proc, AdoptedProcess) and not inst.proc.watched_by_pidfd
    adopted = await wait_state(restarted, "m-1", "Ready")
    assert adopted["pid"] == ready["pid"]
    await crash(restarted, "m-1")
    failed = await wait_state(restarted, "m-1", "Failed")
    assert "after it was ready" in failed["error"] and "RestartBudget" in failed["error"]
    assert failed["pid"] is None


async def test_adopted_engine_is_stopped_on_clean_shutdown(runtime_factory: Any) -> None:
    ready = await left_running(runtime_factory)
    restarted = await runtime_factory()
    await wait_state(restarted, "m-1", "Ready")
    await restarted.close(stop_instances=True)
    assert not psutil.pid_exists(ready["pid"]) or (
        psutil.Process(ready["pid"]).status() == psutil.STATUS_ZOMBIE
    )


async def test_engine_that_cannot_start_is_failed_at_once(
    make_config: Callable[..., AgentConfig], tmp_path: Path
) -> None:
    folder = tmp_path / "broken" / "1"
    folder.mkdir(parents=True)
    script = folder / "llama-server"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    write_manifest(folder, name="llama.cpp", version="1")
    entry = ExecutableEntry(name="llama.cpp", version="1", path=script, default=True)
    config = make_config(executables=(entry,))
    catalogue = Catalogue(entries=config.executables)
    catalogue.verify()
    runtime = ProcessRuntime(config=config, catalogue=catalogue, bus=EventBus())
    await runtime.start()
    try:
        inst = await runtime.launch(launch_body())
        assert inst["state"] == "Failed"
        assert inst["error"].startswith("llama-server could not be started: ")
        assert inst["port"] is not None and inst["pid"] is None
        # Its port went back to the pool.
        again = await runtime.launch(launch_body("m-2"))
        assert again["port"] == inst["port"]
    finally:
        await runtime.close()
