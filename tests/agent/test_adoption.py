"""After an agent restart: what is adopted, what reads gone, which orphans are stopped.

The records are written by hand, as a previous run of the agent would have left them;
the processes are started by the test (so only pids this test owns are ever signalled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from agent_support import (
    Pki,
    client_context,
    launch_body,
    make_identity,
    master_headers,
    start_runtime,
)

from agent._config import AgentConfig, ExecutableEntry
from agent.engines._spec import parse_launch_spec
from agent.engines.process._reconcile import argv_digest, matches_record, observe
from agent.engines.process._runtime import GONE_ERROR, PENDING_STOPPED_ERROR, ProcessRuntime
from protocol.tinygguf import write_tiny_gguf
from tests.parallel import engine_port_range, free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def runtime_factory(
    make_config: Callable[..., AgentConfig], fake_engine: ExecutableEntry
) -> AsyncIterator[Callable[..., Any]]:
    made: list[ProcessRuntime] = []

    async def build() -> ProcessRuntime:
        runtime = await start_runtime(make_config(executables=(fake_engine,)))
        made.append(runtime)
        return runtime

    yield build
    for runtime in made:
        await runtime.close()


@pytest.fixture
def spawned() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start processes for a test; whatever is left is killed by its own pid at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            **kw,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the process for port {port} exited early"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def engine_argv(script: Path, models_root: Path, port: int, alias: str = "demo") -> list[str]:
    model = str((models_root / "demo" / "demo.gguf").resolve())
    return [str(script), "-m", model, "--alias", alias, "--host", "127.0.0.1", "--port", str(port)]


def record(
    instance_id: str,
    *,
    exe: Path,
    state: str = "Ready",
    pid: int | None = None,
    create_time: float | None = None,
    port: int | None = None,
    argv: list[str] | None = None,
    pending_since: float | None = None,
) -> dict[str, Any]:
    """A processes.json record as a previous run of the agent writes it."""
    spec = parse_launch_spec(launch_body(instance_id)).to_json()
    return {
        "instanceId": instance_id,
        "state": state,
        "port": port,
        "pid": pid,
        "restartCount": 0,
        "spec": spec,
        "apiKey": "k" * 43,
        "pendingStart": pending_since is not None,
        "pendingSince": pending_since,
        "argvDigest": argv_digest(argv) if argv else None,
        "pidCreateTime": create_time,
        "pidCmdline": [],
        "executablePath": str(exe.resolve()),
    }


def write_records(state_dir: Path, records: list[dict[str, Any]]) -> None:
    (state_dir / "processes.json").write_text(json.dumps({"version": 1, "instances": records}))


def test_argv_digest_and_script_program(fake_engine: ExecutableEntry, tmp_path: Path) -> None:
    assert argv_digest(["a", "b"]) != argv_digest(["a b"])
    assert argv_digest(["a"]).startswith("sha256:")
    # A #! engine: the kernel reports the interpreter; the program is the script.
    proc = subprocess.Popen(
        [str(fake_engine.path), "--port", "0", "--alias", "x"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={"PATH": os.environ["PATH"]},
    )
    try:
        deadline = time.monotonic() + 5
        obs = None
        while time.monotonic() < deadline:
            obs = observe(proc.pid)
            if obs is not None and obs.argv[:1] == (str(fake_engine.path),):
                break
            time.sleep(0.02)
        assert obs is not None
        assert obs.program == fake_engine.path.resolve()
        assert obs.argv == (str(fake_engine.path), "--port", "0", "--alias", "x")
        good = {
            "pidCreateTime": obs.create_time,
            "executablePath": str(fake_engine.path.resolve()),
            "argvDigest": argv_digest(obs.argv),
        }
        assert matches_record(obs, good)
        assert not matches_record(obs, {**good, "pidCreateTime": obs.create_time - 1})
        assert not matches_record(obs, {**good, "executablePath": "/usr/bin/sleep"})
        assert not matches_record(obs, {**good, "argvDigest": argv_digest(["other"])})
    finally:
        proc.kill()
        proc.wait()


def test_a_process_whose_argument_is_a_fifo_or_a_descriptor_does_not_hang_a_scan(
    tmp_path: Path,
) -> None:
    """observe() reads argv[1] of any process to tell a script; a FIFO there blocked the
    scan forever, and /dev/fd/N named the scanner's own descriptor."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # Python blocks opening its "script" (a FIFO nobody writes): alive, argv[1] the FIFO.
    procs = [
        subprocess.Popen([sys.executable, str(fifo)]),
        subprocess.Popen([sys.executable, "/dev/fd/0"], stdin=subprocess.PIPE),
    ]
    try:
        for proc in procs:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                future = pool.submit(observe, proc.pid)
                try:
                    obs = future.result(timeout=10)
                except concurrent.futures.TimeoutError:
                    with contextlib.suppress(OSError):  # free the thread
                        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                    pytest.fail(f"observe() hung on {proc.args}")
            assert obs is not None
            assert obs.program == Path(sys.executable).resolve(), proc.args
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def test_gone_and_reused_pids_read_stopped_and_are_not_killed(
    runtime_factory: Any,
    state_dir: Path,
    fake_engine: ExecutableEntry,
    spawned: Callable[..., subprocess.Popen[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = spawned(["true"])
    dead.wait()
    wrong_time = spawned(["sleep", "60"])
    wrong_exe = spawned(["sleep", "60"])
    created = psutil.Process(wrong_exe.pid).create_time()
    write_records(
        state_dir,
        [
            # The pid is gone.
            record("dead", exe=fake_engine.path, pid=dead.pid, create_time=time.time(), port=1),
            # The pid is someone else's: a later process (other creation time) ...
            record(
                "reused",
                exe=fake_engine.path,
                pid=wrong_time.pid,
                create_time=psutil.Process(wrong_time.pid).create_time() - 30,
                port=2,
            ),
            # ... or the same creation time (as if) but another program.
            record("other", exe=fake_engine.path, pid=wrong_exe.pid, create_time=created, port=3),
        ],
    )
    caplog.set_level(logging.INFO, logger="mirbad.agent")
    runtime = await runtime_factory()
    for iid in ("dead", "reused", "other"):
        inst = runtime.get(iid).to_json()
        assert inst["state"] == "Stopped" and inst["error"] == GONE_ERROR, inst
        assert inst["pid"] is None
    assert wrong_time.poll() is None and wrong_exe.poll() is None, "nothing may be killed"
    assert "Reconciled: adopted 0, gone 3, orphans stopped 0" in caplog.text
    saved = json.loads((state_dir / "processes.json").read_text())["instances"]
    assert {r["state"] for r in saved} == {"Stopped"}


@pytest.mark.slow
async def test_orphans_are_stopped_and_foreign_processes_left_alone(
    runtime_factory: Any,
    state_dir: Path,
    models_root: Path,
    tmp_path: Path,
    fake_engine: ExecutableEntry,
    spawned: Callable[..., subprocess.Popen[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {"PATH": os.environ["PATH"], "LLAMA_API_KEY": "k" * 43}
    script = fake_engine.path
    elsewhere = tmp_path / "elsewhere" / "llama-server"
    elsewhere.parent.mkdir()
    shutil.copy2(script, elsewhere)
    p_pending, p_foreign, p_other, p_gone = (free_port() for _ in range(4))

    # A pending start whose process came up before the agent died.
    pending_argv = engine_argv(script, models_root, p_pending)
    since = time.time() - 0.2
    orphan = spawned(pending_argv, env=env)
    # The same engine, copied outside the runtimes folder, on a port of ours.
    foreign = spawned(engine_argv(elsewhere, models_root, p_foreign), env=env)
    # Our engine, with arguments no record has, on a port that is not ours.
    other_args = spawned(engine_argv(script, models_root, p_other, alias="mine"), env=env)
    # Our engine on the port of a record whose pid is gone, the port in its argv.
    on_our_port = spawned(engine_argv(script, models_root, p_gone, alias="stray"), env=env)
    for port, proc in (
        (p_pending, orphan),
        (p_foreign, foreign),
        (p_other, other_args),
        (p_gone, on_our_port),
    ):
        wait_listening(port, proc)
    write_records(
        state_dir,
        [
            record(
                "m-1",
                exe=script,
                state="Starting",
                port=p_pending,
                argv=pending_argv,
                pending_since=since,
            ),
            record("m-2", exe=script, state="Stopped", port=p_foreign),
            record("m-3", exe=script, pid=999_999_999, create_time=1.0, port=p_gone),
        ],
    )
    caplog.set_level(logging.INFO, logger="mirbad.agent")
    runtime = await runtime_factory()

    assert orphan.wait(timeout=5) is not None
    assert on_our_port.wait(timeout=5) is not None
    assert foreign.poll() is None and other_args.poll() is None
    text = caplog.text
    assert f"Stopped orphan engine pid {orphan.pid} (instance m-1)" in text
    assert f"Stopped orphan engine pid {on_our_port.pid} (instance m-3)" in text
    assert f"Foreign process pid {foreign.pid} ({elsewhere.resolve()}): left alone" in text
    assert f"Foreign process pid {other_args.pid} ({script.resolve()}): left alone" in text
    assert "Reconciled: adopted 0, gone 1, orphans stopped 2" in text
    m1 = runtime.get("m-1").to_json()
    assert m1["state"] == "Stopped" and m1["error"] == PENDING_STOPPED_ERROR
    assert runtime.get("m-3").to_json()["error"] == GONE_ERROR
    saved = json.loads((state_dir / "processes.json").read_text())["instances"]
    assert not any(r["pendingStart"] for r in saved)


@pytest.mark.slow
async def test_launch_records_a_pending_start_before_the_process(
    runtime_factory: Any, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record on disk at the moment the engine is started is a pending start."""
    import agent.engines.process._runtime as process_module

    seen: list[dict[str, Any]] = []
    real_start = process_module.EngineProcess.start

    def start(argv: list[str], **kw: Any) -> Any:
        [rec] = json.loads((state_dir / "processes.json").read_text())["instances"]
        seen.append({**rec, "argv": argv})
        return real_start(argv, **kw)

    monkeypatch.setattr(process_module.EngineProcess, "start", staticmethod(start))
    runtime = await runtime_factory()
    await runtime.launch(launch_body())
    [pending] = seen
    assert pending["pendingStart"] is True and pending["pid"] is None
    assert pending["argvDigest"] == argv_digest(pending["argv"])
    assert pending["pendingSince"] <= time.time() and pending["apiKey"]
    [rec] = json.loads((state_dir / "processes.json").read_text())["instances"]
    assert rec["pendingStart"] is False and rec["pid"] and rec["pidCreateTime"]
    assert rec["argvDigest"] == pending["argvDigest"]
    obs = observe(rec["pid"])
    assert obs is not None and matches_record(obs, rec)


REPO = Path(__file__).resolve().parents[2]


async def _wait_instance(session: Any, base: str, agent: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + 60
    last: Any = None
    while time.monotonic() < deadline:
        assert agent.poll() is None, "the agent exited"
        try:
            async with session.get(base + "/agent/v1/instances") as resp:
                last = (await resp.json())["instances"]
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.1)
            continue
        if last and last[0]["state"] == "Ready":
            return last[0]
        assert not last or last[0]["state"] == "Starting", last
        await asyncio.sleep(0.1)
    raise AssertionError(f"not Ready: {last}")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_kill_9_of_the_agent_then_restart_adopts_the_engine(
    pki: Pki, tmp_path: Path, models_root: Path, fake_engine: ExecutableEntry
) -> None:
    """``python -m agent run`` killed with SIGKILL; the next one adopts the engine."""
    state = tmp_path / "state"
    make_identity(pki, state, "n1")
    real = os.environ.get("MIRBAD_TEST_LLAMA_SERVER")
    body = launch_body()
    if real:
        exe_path = Path(real)
        version = json.loads((exe_path.parent / "manifest.json").read_text())["version"]
        write_tiny_gguf(models_root / "tiny" / "tiny.gguf")
        args = [
            "-m", "{model}", "--alias", "tiny", "-c", "1024", "-np", "1", "-ngl", "0",
            "--host", "127.0.0.1", "--port", "{port}", "--no-ui", "--cache-ram", "0",
            "--fit", "off",
        ]  # fmt: skip
        body = launch_body(
            servedName="tiny", model={"folder": "tiny", "file": "tiny.gguf"}, args=args
        )
    else:
        exe_path, version = fake_engine.path, fake_engine.version
    port = free_port()
    config = tmp_path / "agent.json"
    config.write_text(
        json.dumps(
            {
                "NodeId": "n1",
                "StateDirectory": str(state),
                "ModelsRoot": str(models_root),
                "Port": port,
                "PortRangeStart": engine_port_range()[0],
                "PortRangeEnd": engine_port_range()[1],
                "Executables": [{"Name": "llama.cpp", "Version": version, "Path": str(exe_path)}],
            }
        )
    )
    base = f"https://127.0.0.1:{port}"
    logs = [tmp_path / "agent-1.log", tmp_path / "agent-2.log"]

    def start_agent(log_path: Path) -> subprocess.Popen[bytes]:
        with open(log_path, "wb") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--config", str(config)],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    ctx = client_context(pki, pki.master, tmp_path / "client")
    agents: list[subprocess.Popen[bytes]] = []
    engine: psutil.Process | None = None
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx), headers=master_headers()
        ) as session:
            agents.append(start_agent(logs[0]))
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with session.post(base + "/agent/v1/instances", json=body) as resp:
                        assert resp.status == 202, await resp.text()
                        break
                except aiohttp.ClientConnectionError:
                    assert time.monotonic() < deadline, logs[0].read_text()
                    assert agents[0].poll() is None, logs[0].read_text()
                    await asyncio.sleep(0.1)
            first = await _wait_instance(session, base, agents[0])
            engine = psutil.Process(first["pid"])
            agents[0].kill()  # SIGKILL: no shutdown code runs at all
            agents[0].wait()
            assert engine.is_running(), "the engine must outlive a killed agent"

            agents.append(start_agent(logs[1]))
            again = await _wait_instance(session, base, agents[1])
            assert again["pid"] == first["pid"] and again["port"] == first["port"]
            text = logs[1].read_text()
            assert f"Adopted instance m-1 (pid {first['pid']}, port {first['port']})" in text
            assert "Reconciled: adopted 1, gone 0, orphans stopped 0" in text
            async with session.post(base + "/agent/v1/instances/m-1/stop") as resp:
                assert resp.status == 200, await resp.text()
            deadline = time.monotonic() + 10
            while engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, "the adopted engine was not stopped"
                await asyncio.sleep(0.05)
            agents[1].send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(agents[1].wait, 30) == 0
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if engine is not None and engine.is_running():
            engine.kill()  # the engine this test's agent started (same creation time)
