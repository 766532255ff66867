"""GPU pinning, one start per GPU, measured memory and GPUs in the heartbeat.

No test needs a GPU: a fake nvidia-smi (an injected probe) lists made-up GPUs whose
memory.used rises by what the fake engines say they allocated, and the fake engine is
the usual one (agent_support.FAKE_ENGINE) behind a prelude that can dump its
environment, allocate RAM (in itself and in a child), "allocate" GPU memory and delay
its Ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from agent_support import FAKE_ENGINE, RunningAgent, launch_body, start_runtime

import agent.telemetry._describe
from agent import InvalidRequest, SpecRejected
from agent._config import AgentConfig, ExecutableEntry
from agent.engines._executables import write_manifest
from agent.engines._spec import fingerprint, parse_launch_spec
from agent.engines.process._runtime import ProcessRuntime
from agent.state._events import EventBus
from agent.telemetry._describe import GpuSampler, group_rss

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

MIB = 2**20
GIB = 2**30
G1 = "GPU-11111111-1111-1111-1111-111111111111"
G2 = "GPU-22222222-2222-2222-2222-222222222222"
G3 = "GPU-33333333-3333-3333-3333-333333333333"
GA = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"

# Runs before the fake engine binds its port, i.e. before it can be Ready.
PRELUDE = textwrap.dedent(
    r"""
    import json as _json, os as _os, subprocess as _sp, sys as _sys, threading as _th
    import time as _time

    def _write_atomic(path, text):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        _os.rename(path + ".tmp", path)

    if _os.environ.get("FAKE_ENV_FILE"):
        _write_atomic(_os.environ["FAKE_ENV_FILE"], _json.dumps(dict(_os.environ)))
    # The fake nvidia-smi adds what each engine wrote here to its GPUs' memory.used.
    if _os.environ.get("FAKE_GPU_DIR"):
        _mib = int(_os.environ.get("FAKE_GPU_ALLOC_MIB", "0"))
        _gpus = [u for u in _os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if u]
        _write_atomic(
            _os.path.join(_os.environ["FAKE_GPU_DIR"], f"{_os.getpid()}.json"),
            _json.dumps({u: _mib << 20 for u in _gpus}),
        )
    # Resident for real: bytes * n writes every page.
    _hold = b"\x01" * (int(_os.environ.get("FAKE_ALLOC_MIB", "0")) << 20)
    if _os.environ.get("FAKE_CHILD_ALLOC_MIB"):
        _pid_file = _os.environ["FAKE_CHILD_PID_FILE"]
        _sp.Popen([_sys.executable, "-c",
                   "import os, sys, time\n"
                   "b = b'\x01' * (int(sys.argv[1]) << 20)\n"
                   "open(sys.argv[2] + '.tmp', 'w').write(str(os.getpid()))\n"
                   "os.rename(sys.argv[2] + '.tmp', sys.argv[2])\n"
                   "time.sleep(300)\n",
                   _os.environ["FAKE_CHILD_ALLOC_MIB"], _pid_file])
        while not _os.path.exists(_pid_file):
            _time.sleep(0.01)
    if _os.environ.get("FAKE_GROW_MIB"):
        _grown = []
        def _grow():
            _time.sleep(float(_os.environ.get("FAKE_GROW_AFTER", "0.5")))
            _grown.append(b"\x02" * (int(_os.environ["FAKE_GROW_MIB"]) << 20))
        _th.Thread(target=_grow, daemon=True).start()
    # Not Ready for a while, but holding its port from the start: the socket listens,
    # requests wait in the backlog until serve_forever runs.
    if _os.environ.get("FAKE_READY_DELAY"):
        import socketserver as _ss
        _serve = _ss.BaseServer.serve_forever
        def _late(self, *a, **k):
            _time.sleep(float(_os.environ["FAKE_READY_DELAY"]))
            return _serve(self, *a, **k)
        _ss.BaseServer.serve_forever = _late
    """
)


class FakeSmi:
    """An injected GPU probe: fixed GPUs whose memory.used rises with the fake engines."""

    def __init__(self, folder: Path, base: dict[str, int]) -> None:
        self.folder = folder
        self.base = base
        self.calls = 0
        self.error: str | None = None

    def __call__(self) -> tuple[list[dict[str, Any]], str | None]:
        self.calls += 1
        if self.error is not None:
            return [], self.error
        extra: Counter[str] = Counter()
        for path in self.folder.glob("*.json"):
            for uuid, size in json.loads(path.read_text()).items():
                extra[uuid] += size
        gpus = [
            {
                "index": index,
                "uuid": uuid,
                "name": "Fake GPU",
                "memoryTotalBytes": 16 * GIB,
                "memoryUsedBytes": used + extra[uuid],
                "driverVersion": "0.0",
            }
            for index, (uuid, used) in enumerate(self.base.items())
        ]
        return gpus, None


@pytest.fixture
def gpu_engine(tmp_path: Path) -> ExecutableEntry:
    """A verified executable folder whose llama-server is the fake engine behind PRELUDE."""
    folder = tmp_path / "runtimes" / "llama.cpp" / "fake-gpu"
    folder.mkdir(parents=True)
    script = folder / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + PRELUDE + FAKE_ENGINE)
    script.chmod(0o755)
    write_manifest(folder, name="llama.cpp", version="fake-gpu")
    return ExecutableEntry(name="llama.cpp", version="fake-gpu", path=script, default=True)


@pytest.fixture
def smi(tmp_path: Path) -> FakeSmi:
    folder = tmp_path / "gpu-alloc"
    folder.mkdir()
    return FakeSmi(folder, {G1: 1 * GIB, G2: 2 * GIB, G3: 3 * GIB})


@pytest.fixture
async def runtime_factory(
    make_config: Callable[..., AgentConfig], gpu_engine: ExecutableEntry, smi: FakeSmi
) -> AsyncIterator[Callable[..., Any]]:
    made: list[ProcessRuntime] = []

    async def build(**kw: Any) -> ProcessRuntime:
        runtime = await start_runtime(
            make_config(executables=(gpu_engine,)),
            ready_poll_interval=0.05,
            gpu_probe=kw.pop("gpu_probe", smi),
            **kw,
        )
        made.append(runtime)
        return runtime

    yield build
    for runtime in made:
        await runtime.close()


def gpu_env(smi: FakeSmi, **extra: str) -> dict[str, str]:
    return {"FAKE_GPU_DIR": str(smi.folder), **extra}


async def wait_state(
    runtime: ProcessRuntime, instance_id: str, *states: str, within: float = 20
) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        inst = runtime.get(instance_id).to_json()
        if inst["state"] in states:
            return inst
        await asyncio.sleep(0.02)
    raise AssertionError(f"{instance_id} never reached {states}: {inst}")


def record_of(state_dir: Path, instance_id: str) -> dict[str, Any]:
    records = json.loads((state_dir / "processes.json").read_text())["instances"]
    return next(r for r in records if r["instanceId"] == instance_id)


# -- the spec ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("GPU-11111111", "'gpuUuids' must be a list"),
        ([G1] * 1 + [f"GPU-{i:08x}" for i in range(16)], "at most 16"),
        (["gpu-11111111"], "gpuUuids[0]"),
        ([G1, "GPU-xyz12345"], "gpuUuids[1]"),
        (["GPU-1234"], "gpuUuids[0]"),
        ([f"{G1},{G2}"], "gpuUuids[0]"),
        ([7], "gpuUuids[0]"),
        ([G1, G2, G1], "names GPU-1111"),
        ([GA, GA.upper()], "twice"),
    ],
)
def test_gpu_uuids_shape_is_checked(value: Any, needle: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_launch_spec(launch_body(gpuUuids=value))
    assert needle in info.value.message and "gpuUuids" in info.value.message


def test_gpu_uuids_parse_and_keep_out_of_the_fingerprint() -> None:
    mig = "MIG-a1b2c3d4-e5f6-5a7b-8c9d-0e1f2a3b4c5d"
    spec = parse_launch_spec(launch_body(gpuUuids=[G2, G1, mig]))
    assert spec.gpu_uuids == (G2, G1, mig)  # the placement order, not sorted
    assert parse_launch_spec(spec.to_json()) == spec
    plain = parse_launch_spec(launch_body())
    for absent in (None, []):
        assert parse_launch_spec(launch_body(gpuUuids=absent)).gpu_uuids == ()
    assert plain.gpu_uuids == () and plain.to_json()["gpuUuids"] == []
    # The fingerprint is the master's formula: argv, executable version, env names.
    assert fingerprint(spec, "v1") == fingerprint(plain, "v1")


async def test_spec_env_cannot_set_cuda_visible_devices(runtime_factory: Any) -> None:
    runtime = await runtime_factory()
    with pytest.raises(SpecRejected, match="CUDA_VISIBLE_DEVICES is refused"):
        await runtime.launch(launch_body(env={"CUDA_VISIBLE_DEVICES": G1}))
    assert runtime.list() == []


async def test_unknown_gpu_is_refused_naming_what_the_node_has(
    runtime_factory: Any, smi: FakeSmi
) -> None:
    runtime = await runtime_factory()
    with pytest.raises(SpecRejected) as info:
        await runtime.launch(launch_body(gpuUuids=[G1, "GPU-deadbeef-0000"]))
    message = info.value.message
    assert message.startswith("gpuUuids: GPU-deadbeef-0000 is not a GPU of this node")
    assert all(u in message for u in (G1, G2, G3))
    assert info.value.details == {
        "field": "gpuUuids",
        "unknown": ["GPU-deadbeef-0000"],
        "nodeGpus": [G1, G2, G3],
    }
    assert runtime.list() == []
    # A node without nvidia-smi has no GPU to pin.
    bare = await runtime_factory(
        gpu_probe=lambda: ([], agent.telemetry._describe.NVIDIA_SMI_ABSENT)
    )
    with pytest.raises(SpecRejected, match="it has none: nvidia-smi is not installed"):
        await bare.launch(launch_body(gpuUuids=[G1]))
    smi.error = "nvidia-smi exited with 9: driver wedged"
    broken = await runtime_factory()
    with pytest.raises(SpecRejected, match="it has none: nvidia-smi exited with 9"):
        await broken.launch(launch_body(gpuUuids=[G1]))


# -- pinning and the per-GPU start lock ------------------------------------------------


async def test_engine_gets_cuda_visible_devices_in_spec_order(
    runtime_factory: Any, tmp_path: Path
) -> None:
    runtime = await runtime_factory()
    gpu_dump, cpu_dump = tmp_path / "gpu-env.json", tmp_path / "cpu-env.json"
    first = await runtime.launch(
        launch_body("g", gpuUuids=[G2, G1], env={"FAKE_ENV_FILE": str(gpu_dump)})
    )
    assert first["gpuUuids"] == [G2, G1] and first["pid"] and first["startQueuedAt"] is None
    await runtime.launch(launch_body("c", env={"FAKE_ENV_FILE": str(cpu_dump)}))
    await wait_state(runtime, "g", "Ready")
    await wait_state(runtime, "c", "Ready")
    assert json.loads(gpu_dump.read_text())["CUDA_VISIBLE_DEVICES"] == f"{G2},{G1}"
    assert "CUDA_VISIBLE_DEVICES" not in json.loads(cpu_dump.read_text())
    assert runtime.get("c").to_json()["gpuUuids"] == []


async def test_two_starts_on_one_gpu_do_not_overlap(runtime_factory: Any, smi: FakeSmi) -> None:
    runtime = await runtime_factory()
    slow = gpu_env(smi, FAKE_READY_DELAY="0.6")
    a = await runtime.launch(launch_body("a", gpuUuids=[G1], env=slow))
    b = await runtime.launch(launch_body("b", gpuUuids=[G1], env=slow))
    assert a["pid"] and a["startQueuedAt"] is None
    # b is answered at once, queued: Starting, no process and no port yet.
    assert b["state"] == "Starting" and b["pid"] is None and b["port"] is None
    assert b["startQueuedAt"] is not None
    await asyncio.sleep(0.3)
    assert runtime.get("b").to_json()["pid"] is None
    await wait_state(runtime, "a", "Ready")
    ready_b = await wait_state(runtime, "b", "Ready")
    inst_a, inst_b = runtime.get("a"), runtime.get("b")
    assert inst_a.ready_at is not None and inst_b.started_at is not None
    assert inst_b.started_at >= inst_a.ready_at, "b's engine started before a was Ready"
    assert ready_b["startQueuedAt"] is None and ready_b["port"] != inst_a.port


async def test_starts_on_different_gpus_run_in_parallel(runtime_factory: Any, smi: FakeSmi) -> None:
    runtime = await runtime_factory()
    slow = gpu_env(smi, FAKE_READY_DELAY="0.6")
    a = await runtime.launch(launch_body("a", gpuUuids=[G1], env=slow))
    b = await runtime.launch(launch_body("b", gpuUuids=[G2], env=slow))
    cpu = await runtime.launch(launch_body("cpu", env=slow))
    assert a["pid"] and b["pid"] and cpu["pid"]
    assert b["startQueuedAt"] is None and cpu["startQueuedAt"] is None
    for iid in ("a", "b", "cpu"):
        await wait_state(runtime, iid, "Ready")
    inst_a, inst_b = runtime.get("a"), runtime.get("b")
    assert inst_a.ready_at is not None and inst_b.started_at is not None
    assert inst_b.started_at < inst_a.ready_at, "b waited for a though they share no GPU"


async def test_multi_gpu_start_waits_for_every_gpu(runtime_factory: Any, smi: FakeSmi) -> None:
    runtime = await runtime_factory()
    a = await runtime.launch(launch_body("a", gpuUuids=[G1], env=gpu_env(smi)))
    b = await runtime.launch(
        launch_body("b", gpuUuids=[G2], env=gpu_env(smi, FAKE_READY_DELAY="0.8"))
    )
    # Listed in the other order than the sorted one the locks are taken in.
    both = await runtime.launch(launch_body("both", gpuUuids=[G2, G1], env=gpu_env(smi)))
    assert a["pid"] and b["pid"] and both["pid"] is None and both["startQueuedAt"]
    await wait_state(runtime, "a", "Ready")
    await asyncio.sleep(0.1)
    assert runtime.get("both").to_json()["pid"] is None, "started while G2's start ran"
    await wait_state(runtime, "both", "Ready")
    inst_b, inst_both = runtime.get("b"), runtime.get("both")
    assert inst_b.ready_at is not None and inst_both.started_at is not None
    assert inst_both.started_at >= inst_b.ready_at


async def test_opposite_gpu_orders_do_not_deadlock(runtime_factory: Any, smi: FakeSmi) -> None:
    runtime = await runtime_factory()
    await runtime.launch(launch_body("h1", gpuUuids=[G1], env=gpu_env(smi, FAKE_READY_DELAY="0.3")))
    await runtime.launch(launch_body("h2", gpuUuids=[G2], env=gpu_env(smi, FAKE_READY_DELAY="0.8")))
    # Both queued; taken in their own order, x would hold G1 waiting for G2 and y the
    # other way round. Sorted, both queue on G1 first.
    x = await runtime.launch(launch_body("x", gpuUuids=[G1, G2], env=gpu_env(smi)))
    y = await runtime.launch(launch_body("y", gpuUuids=[G2, G1], env=gpu_env(smi)))
    assert x["startQueuedAt"] and y["startQueuedAt"]
    await wait_state(runtime, "x", "Ready", within=8)
    await wait_state(runtime, "y", "Ready", within=8)


async def test_stop_or_failure_frees_the_gpu(runtime_factory: Any, smi: FakeSmi) -> None:
    runtime = await runtime_factory()
    slow = gpu_env(smi, FAKE_READY_DELAY="30")
    await runtime.launch(launch_body("a", gpuUuids=[G1], env=slow))
    queued = await runtime.launch(launch_body("b", gpuUuids=[G1], env=gpu_env(smi)))
    assert queued["pid"] is None
    stopped = await runtime.stop("b")
    assert stopped["state"] == "Stopped" and stopped["startQueuedAt"] is None
    await runtime.stop("a")  # a start that never got Ready
    c = await runtime.launch(
        launch_body("c", gpuUuids=[G1], env=gpu_env(smi, FAKE_MODE="exit_early"))
    )
    assert c["pid"], "the GPU was still held after both starts were stopped"
    await runtime.launch(launch_body("d", gpuUuids=[G1], env=gpu_env(smi)))
    await wait_state(runtime, "c", "Failed")
    ready = await wait_state(runtime, "d", "Ready")
    assert ready["measured"]["kind"] == "gpu-delta"


async def test_restart_after_ready_waits_for_its_gpu(runtime_factory: Any, smi: FakeSmi) -> None:
    runtime = await runtime_factory()
    await runtime.launch(launch_body("a", gpuUuids=[G1], env=gpu_env(smi)))
    await wait_state(runtime, "a", "Ready")
    await runtime.launch(launch_body("b", gpuUuids=[G1], env=gpu_env(smi, FAKE_READY_DELAY="1.0")))
    inst_a = runtime.get("a")
    old_pid = inst_a.pid
    assert inst_a.proc is not None
    await inst_a.proc.kill_group(1.0)  # a crash after Ready
    deadline = time.monotonic() + 5
    while inst_a.restart_count == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    waiting = inst_a.to_json()
    assert waiting["state"] == "Starting" and waiting["pid"] is None
    assert waiting["startQueuedAt"] is not None and waiting["measured"] is None
    inst_b = runtime.get("b")
    again = await wait_state(runtime, "a", "Ready")
    assert again["pid"] != old_pid and again["restartCount"] == 1
    assert inst_b.ready_at is not None and inst_a.started_at is not None
    assert inst_a.started_at >= inst_b.ready_at


async def test_queued_start_reads_stopped_after_an_agent_restart(
    runtime_factory: Any, smi: FakeSmi
) -> None:
    first = await runtime_factory()
    await first.launch(launch_body("a", gpuUuids=[G1], env=gpu_env(smi, FAKE_READY_DELAY="30")))
    await first.launch(launch_body("b", gpuUuids=[G1], env=gpu_env(smi)))
    await first.close(stop_instances=False)
    second = await runtime_factory()
    b = second.get("b").to_json()
    assert b["state"] == "Stopped" and b["startQueuedAt"] is None
    assert "waiting for its GPUs" in b["error"]


# -- measured memory -----------------------------------------------------------------


async def test_rss_measurement_sums_the_process_group(
    runtime_factory: Any, tmp_path: Path, state_dir: Path
) -> None:
    runtime = await runtime_factory()
    pid_file = tmp_path / "child.pid"
    env = {
        "FAKE_ALLOC_MIB": "50",
        "FAKE_CHILD_ALLOC_MIB": "30",
        "FAKE_CHILD_PID_FILE": str(pid_file),
    }
    started = await runtime.launch(launch_body(env=env))
    assert started["measured"] is None
    ready = await wait_state(runtime, "m-1", "Ready")
    measured = ready["measured"]
    assert measured["kind"] == "rss" and "perGpu" not in measured
    assert measured["at"].endswith("Z") and measured["peakBytes"] == measured["bytes"]
    leader = psutil.Process(ready["pid"]).memory_info().rss
    child = psutil.Process(int(pid_file.read_text())).memory_info().rss
    assert child > 25 * MIB and leader > 45 * MIB
    # The child is counted, and the sum is what psutil sees for the two processes.
    assert measured["bytes"] > leader + 20 * MIB
    assert abs(measured["bytes"] - (leader + child)) < 0.1 * (leader + child)
    assert record_of(state_dir, "m-1")["measured"] == measured
    stopped = await runtime.stop("m-1")
    assert stopped["measured"] is None


async def test_rss_is_refreshed_while_ready_and_keeps_the_peak(
    runtime_factory: Any, state_dir: Path
) -> None:
    runtime = await runtime_factory(measure_refresh_seconds=0.1)
    bus: EventBus = runtime._bus
    with bus.subscribe() as events:
        await runtime.launch(launch_body(env={"FAKE_GROW_MIB": "60", "FAKE_GROW_AFTER": "0.4"}))
        first = (await wait_state(runtime, "m-1", "Ready"))["measured"]
        deadline = time.monotonic() + 10
        while runtime.get("m-1").to_json()["measured"]["bytes"] < first["bytes"] + 50 * MIB:
            assert time.monotonic() < deadline, runtime.get("m-1").to_json()
            await asyncio.sleep(0.05)
        states = []
        while True:
            try:
                async with asyncio.timeout(0.1):
                    event = await events.get()
            except TimeoutError:
                break
            assert event is not None
            states.append(event.data["state"])
    grown = runtime.get("m-1").to_json()["measured"]
    assert grown["peakBytes"] >= grown["bytes"] and grown["at"] >= first["at"]
    assert states == ["Starting", "Ready"], "a refresh is not a state change"
    assert record_of(state_dir, "m-1")["measured"]["bytes"] >= first["bytes"] + 50 * MIB


async def test_gpu_delta_is_measured_over_the_start(
    runtime_factory: Any, smi: FakeSmi, state_dir: Path
) -> None:
    runtime = await runtime_factory()
    env = gpu_env(smi, FAKE_GPU_ALLOC_MIB="300", FAKE_ALLOC_MIB="40")
    started = await runtime.launch(launch_body(gpuUuids=[G2, G1], env=env))
    assert started["measured"] is None
    ready = await wait_state(runtime, "m-1", "Ready")
    measured = ready["measured"]
    assert measured["kind"] == "gpu-delta" and "note" not in measured
    assert measured["perGpu"] == {G2: 300 * MIB, G1: 300 * MIB}
    assert measured["bytes"] == measured["peakBytes"] == 600 * MIB  # not the 40 MiB of RSS
    record = record_of(state_dir, "m-1")
    assert record["measured"] == measured
    assert record["gpuBaselineBytes"] == {G2: 2 * GIB, G1: 1 * GIB}


async def test_gpu_delta_never_goes_negative(runtime_factory: Any, smi: FakeSmi) -> None:
    runtime = await runtime_factory()
    env = gpu_env(smi, FAKE_GPU_ALLOC_MIB="-200")
    await runtime.launch(launch_body(gpuUuids=[G1], env=env))
    measured = (await wait_state(runtime, "m-1", "Ready"))["measured"]
    assert measured["bytes"] == 0 and measured["perGpu"] == {G1: 0}
    assert f"fell during the start on {G1} by 200 MiB" in measured["note"]


async def test_gpu_start_without_a_probe_answer_is_not_measured(
    runtime_factory: Any, smi: FakeSmi
) -> None:
    runtime = await runtime_factory()
    await runtime.launch(launch_body(gpuUuids=[G1], env=gpu_env(smi, FAKE_READY_DELAY="0.3")))
    smi.error = "nvidia-smi failed: timed out"  # the "after" sample fails
    ready = await wait_state(runtime, "m-1", "Ready")
    assert ready["measured"] is None


async def test_measurements_survive_adoption(
    runtime_factory: Any, smi: FakeSmi, state_dir: Path
) -> None:
    first = await runtime_factory()
    await first.launch(launch_body("cpu", env={"FAKE_ALLOC_MIB": "30"}))
    await first.launch(
        launch_body("gpu", gpuUuids=[G3], env=gpu_env(smi, FAKE_GPU_ALLOC_MIB="100"))
    )
    cpu = (await wait_state(first, "cpu", "Ready"))["measured"]
    gpu = (await wait_state(first, "gpu", "Ready"))["measured"]
    await first.close(stop_instances=False)
    assert record_of(state_dir, "cpu")["measured"] == cpu
    await asyncio.sleep(0.01)  # so a re-measurement has a later time stamp
    second = await runtime_factory()
    # Adopted: the measurement is there at once, before the Ready probe passed again.
    assert second.get("cpu").to_json()["measured"] == cpu
    assert second.get("gpu").to_json()["measured"] == gpu
    cpu_again = (await wait_state(second, "cpu", "Ready"))["measured"]
    gpu_again = (await wait_state(second, "gpu", "Ready"))["measured"]
    # RSS is measured again after adoption; the GPU delta cannot be and is kept.
    assert cpu_again["kind"] == "rss" and cpu_again["at"] > cpu["at"]
    assert cpu_again["peakBytes"] >= cpu["peakBytes"] and cpu_again["bytes"] > 25 * MIB
    assert gpu_again == gpu and gpu["bytes"] == 100 * MIB
    assert record_of(state_dir, "gpu")["measured"] == gpu


def test_group_rss_counts_a_group_member_that_is_not_a_descendant() -> None:
    # sh puts sleep in the background and exits: sleep is re-parented, but stays in the
    # group, as a helper an engine forked would.
    leader = psutil.Popen(
        [sys.executable, "-c", "import subprocess, time\n"
         "subprocess.run(['sh', '-c', 'sleep 30 &'])\ntime.sleep(30)"],
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 5
        members: list[psutil.Process] = []
        while time.monotonic() < deadline:
            members = [
                p for p in psutil.process_iter(["name"]) if p.info["name"] == "sleep"
                and _pgid(p.pid) == leader.pid
            ]  # fmt: skip
            if members and not leader.children():
                break
            time.sleep(0.02)
        assert members and not leader.children(), "the orphan was not set up"
        total, count = group_rss(leader.pid)
        assert count == 2
        assert total == pytest.approx(
            leader.memory_info().rss + members[0].memory_info().rss, rel=0.1
        )
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_group_rss_of_a_vanished_group_is_zero() -> None:
    proc = psutil.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert group_rss(proc.pid) == (0, 0)
    total, count = group_rss(os.getpid())
    assert count >= 1 and total >= psutil.Process().memory_info().rss


# -- the probe cache and the heartbeat --------------------------------------------------


async def test_sampler_never_blocks_and_probes_once_at_a_time() -> None:
    release = threading.Event()
    calls = 0

    def slow_probe() -> tuple[list[dict[str, Any]], str | None]:
        nonlocal calls
        calls += 1
        release.wait(5)
        return [{"uuid": G1, "memoryUsedBytes": 1}], None

    sampler = GpuSampler(slow_probe, max_age=5.0)
    started = time.monotonic()
    assert sampler.cached() == ([], None)
    assert sampler.cached() == ([], None)
    assert time.monotonic() - started < 0.1
    release.set()
    gpus, error = await sampler.current()  # waits for the refresh in flight
    assert gpus == [{"uuid": G1, "memoryUsedBytes": 1}] and error is None
    assert calls == 1
    assert sampler.cached()[0] == gpus and calls == 1  # fresh: no new probe
    await sampler.close()


async def test_sampler_logs_each_problem_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mirbad.agent.describe")
    answer: tuple[list[dict[str, Any]], str | None] = (
        [],
        agent.telemetry._describe.NVIDIA_SMI_ABSENT,
    )
    sampler = GpuSampler(lambda: answer, max_age=0.0)
    for _ in range(3):
        assert await sampler.sample() == ([], None)  # absent is not an error
    assert sampler.absent
    answer = ([], "nvidia-smi exited with 9: wedged")
    for _ in range(3):
        assert await sampler.sample() == ([], "nvidia-smi exited with 9: wedged")
    assert not sampler.absent
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "nvidia-smi is not installed; this node reports no GPUs",
        "GPU probe failed: nvidia-smi exited with 9: wedged",
    ]


async def next_heartbeat(running_agent: RunningAgent) -> dict[str, Any]:
    events = await running_agent.session.get(running_agent.url("/agent/v1/events"))
    try:
        event = ""
        while True:
            line = (await events.content.readline()).decode()
            if line.startswith("event: "):
                event = line[7:].strip()
            elif line.startswith("data: ") and event == "heartbeat":
                return json.loads(line[6:])
    finally:
        events.close()


async def test_heartbeat_carries_gpus(
    running_agent: RunningAgent, smi: FakeSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's runtime uses the module's probe_gpus, looked up at each probe.
    monkeypatch.setattr(agent.telemetry._describe, "probe_gpus", smi)
    sampler = running_agent.server.runtime.gpus
    await sampler.sample()
    beat = await next_heartbeat(running_agent)
    assert [g["uuid"] for g in beat["gpus"]] == [G1, G2, G3]
    assert beat["gpus"][1] == {
        "index": 1,
        "uuid": G2,
        "name": "Fake GPU",
        "memoryTotalBytes": 16 * GIB,
        "memoryUsedBytes": 2 * GIB,
    }
    assert "gpuProbeError" not in beat
    smi.error = "nvidia-smi exited with 9: wedged"
    await sampler.sample()
    beat = await next_heartbeat(running_agent)
    assert beat["gpus"] == [] and beat["gpuProbeError"] == "nvidia-smi exited with 9: wedged"
    monkeypatch.setattr(
        agent.telemetry._describe,
        "probe_gpus",
        lambda: ([], agent.telemetry._describe.NVIDIA_SMI_ABSENT),
    )
    await sampler.sample()
    beat = await next_heartbeat(running_agent)
    assert beat["gpus"] == [] and "gpuProbeError" not in beat


async def test_launch_api_checks_gpu_uuids(
    running_agent: RunningAgent, smi: FakeSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent.telemetry._describe, "probe_gpus", smi)
    await running_agent.server.runtime.gpus.sample()
    url = running_agent.url("/agent/v1/instances")
    async with running_agent.session.post(url, json=launch_body(gpuUuids=["nope"])) as resp:
        body = await resp.json()
    assert resp.status == 400 and body["error"]["code"] == "invalid_request"
    assert "gpuUuids[0]" in body["error"]["message"]
    unknown = "GPU-99999999-9999"
    async with running_agent.session.post(url, json=launch_body(gpuUuids=[unknown])) as resp:
        body = await resp.json()
    assert resp.status == 422 and body["error"]["code"] == "spec_rejected"
    assert unknown in body["error"]["message"] and G1 in body["error"]["message"]
