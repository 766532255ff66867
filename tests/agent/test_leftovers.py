"""stop_recorded_engines: what a supervisor stops after its agent died, from the records.

Only processes this test started are ever signalled: the engines (fake llama-server
scripts in the runtimes folder) and a ``sleep`` whose pid a record names wrongly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_adoption import (  # the adoption tests' helpers and their spawned fixture
    engine_argv,
    free_port,
    record,
    spawned,  # noqa: F401
    wait_listening,
    write_records,
)

from agent import stop_recorded_engines
from agent._config import AgentConfig, ExecutableEntry

pytestmark = pytest.mark.timeout(60)


def test_recorded_engines_are_stopped_and_nothing_else(
    make_config: Callable[..., AgentConfig],
    state_dir: Path,
    models_root: Path,
    fake_engine: ExecutableEntry,
    spawned: Callable[..., Any],  # noqa: F811
) -> None:
    env = {"PATH": os.environ["PATH"], "LLAMA_API_KEY": "k" * 43}
    script = fake_engine.path
    ready_port, pending_port = free_port(), free_port()
    ready_argv = engine_argv(script, models_root, ready_port)
    ready = spawned(ready_argv, env=env)
    since = time.time() - 0.2
    pending_argv = engine_argv(script, models_root, pending_port, alias="pending")
    pending = spawned(pending_argv, env=env)
    bystander = spawned(["sleep", "60"])
    wait_listening(ready_port, ready)
    wait_listening(pending_port, pending)
    created = psutil.Process(ready.pid).create_time()
    write_records(
        state_dir,
        [
            record("m-1", exe=script, pid=ready.pid, create_time=created, argv=ready_argv),
            record(
                "m-2",
                exe=script,
                state="Starting",
                argv=pending_argv,
                pending_since=since,
            ),
            # A pid that is not the recorded engine (another program): left alone.
            record(
                "m-3",
                exe=script,
                pid=bystander.pid,
                create_time=psutil.Process(bystander.pid).create_time(),
            ),
        ],
    )

    stopped = stop_recorded_engines(make_config(executables=(fake_engine,)), grace=5)

    assert sorted(stopped) == sorted([ready.pid, pending.pid])
    assert ready.wait(timeout=5) is not None
    assert pending.wait(timeout=5) is not None
    assert bystander.poll() is None, "a process that is not provably ours must not be touched"


def test_no_records_no_executables_stop_nothing(
    make_config: Callable[..., AgentConfig], state_dir: Path, fake_engine: ExecutableEntry
) -> None:
    assert stop_recorded_engines(make_config(executables=(fake_engine,))) == []
    (state_dir / "processes.json").write_text("{not json")
    assert stop_recorded_engines(make_config(executables=(fake_engine,))) == []
    write_records(state_dir, [record("m-1", exe=fake_engine.path, pid=os.getpid(), create_time=1)])
    assert stop_recorded_engines(make_config()) == []


def test_the_stop_engines_command_the_launcher_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m agent stop-engines``: JSON of the stopped pids, refusals name the fix."""
    import json

    from agent.__main__ import main

    monkeypatch.delenv("MIRBAD_AGENT_CONFIG", raising=False)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"NodeId": "n1", "StateDirectory": str(state)}))
    assert main(["stop-engines", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == {"stopped": [], "containers": []}

    assert main(["stop-engines"]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["stop-engines", "--config", str(tmp_path / "missing.json")]) == 1
    assert "missing.json: the config file does not exist" in capsys.readouterr().err
