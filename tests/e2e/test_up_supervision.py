"""``./mirbad up`` supervises: what is killed comes back, one stack per data directory,
and nothing it started outlives it (issue 11, parts 2, 3 and 10).

Real processes: the launcher, its children and a real llama-server for ``tiny``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import redis

from core.config import embedded_redis_socket
from tests.e2e.conftest import ROOT, Stack, create_and_start, llama_server_or_fail, wait_for

pytestmark = pytest.mark.slow

TINY = {
    "servedName": "tiny",
    "sourceFolder": "tiny",
    "sourceFile": "tiny.gguf",
    "settings": {"context_size": 256, "parallel": 1, "gpu_layers": 0},
    "node": "local",
}


def _serves(stack: Stack, key: str) -> bool:
    try:
        response = httpx.post(
            f"{stack.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
            },
            timeout=30,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _healthz(stack: Stack) -> tuple[int, dict]:
    try:
        response = httpx.get(f"{stack.url}/healthz", timeout=5)
    except httpx.HTTPError:
        return 0, {}
    return response.status_code, response.json()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _engines(stack: Stack) -> list[psutil.Process]:
    return [p for p in stack.leftovers() if "llama-server" in " ".join(p.cmdline())]


def test_each_child_killed_with_9_comes_back_and_a_stopped_monitor_is_stale(make_stack) -> None:
    llama_server_or_fail()
    stack = make_stack(embedded=True)
    stack.prepare_local_model()
    key = stack.start()["API key"]
    create_and_start(stack.api(key, timeout=30), TINY)
    assert _serves(stack, key)
    assert _healthz(stack)[0] == 200

    # Stopped, not dead: the launcher must not restart it, /healthz must call it stale.
    monitor = stack.pid("monitor")
    stopped_at = time.monotonic()
    psutil.Process(monitor).suspend()
    try:
        status, body = wait_for(
            lambda: (r := _healthz(stack))[0] == 503 and r, 40, "/healthz to report the monitor"
        )
        print(f"/healthz 503 {time.monotonic() - stopped_at:.1f} s after SIGSTOP: {body}")
        # The age is shown rounded to 0.1 s: 15.04 s is stale and reads 15.0.
        assert body["monitor"] == "stale" and body["monitorBeatAgeSeconds"] >= 15
        assert body["database"] == body["redis"] == "ok"
        assert stack.pid("monitor") == monitor
    finally:
        psutil.Process(monitor).resume()
    wait_for(lambda: _healthz(stack)[0] == 200, 30, "/healthz ok after SIGCONT")

    for name in ("monitor", "agent", "worker", "beat", "web", "enroll"):
        old = stack.pid(name)
        worker_children = (
            [c.pid for c in psutil.Process(old).children(recursive=True)]
            if name == "worker"
            else []
        )
        killed_at = time.monotonic()
        psutil.Process(old).kill()
        wait_for(
            lambda n=name, o=old: stack.pid(n) != o and _alive(stack.pid(n)),
            30,
            f"{name} to be restarted",
        )
        wait_for(lambda: _serves(stack, key), 120, f"/v1 to serve again after {name}")
        print(f"{name}: /v1 serves {time.monotonic() - killed_at:.1f} s after kill -9")
        output = "\n".join(stack.lines)
        assert f"{name} exited with signal SIGKILL (-9)" in output, output
        assert f"{name} restarted (pid {stack.pid(name)}" in output, output
        log = (stack.data / "logs" / f"{name}.log").read_text(errors="replace")
        assert f"mirbad: {name} restarted" in log
        assert not [p for p in worker_children if _alive(p)], "a child of the worker outlived it"
    # Exactly one beat: its own supervised child, never a fork left by a dead worker.
    beats = [p for p in stack.leftovers() if "beat" in p.cmdline()]
    assert [p.pid for p in beats] == [stack.pid("beat")]
    assert _healthz(stack)[0] == 200

    # What the console's overview reads.
    status = json.loads((stack.data / "run" / "supervision.json").read_text())
    for name in ("monitor", "agent", "worker", "beat", "web", "enroll"):
        record = status["children"][name]
        assert record["restarts"] == 1 and record["lastExit"] == -9, (name, record)
    assert stack.stop() == 0
    wait_for(lambda: not stack.leftovers(), 30, "every process of the stack to exit")


def test_one_stack_per_data_directory_and_nothing_outlives_the_launcher(make_stack) -> None:
    llama_server_or_fail()
    stack = make_stack(embedded=True)
    stack.prepare_local_model()
    key = stack.start()["API key"]
    api = stack.api(key, timeout=30)
    model_id = create_and_start(api, TINY)
    socket_path = embedded_redis_socket(stack.data)
    assert stack.process is not None
    first_pid = stack.process.pid

    # A second up on the same data directory (and ports): refused, naming the first.
    second = subprocess.run(
        [sys.executable, "-m", "mirbad_site.launcher", "up"],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"(pid {first_pid}) is running" in second.stderr, second.stderr
    assert redis.Redis(unix_socket_path=str(socket_path)).ping()
    assert _serves(stack, key)

    # kill -9 of the launcher: every child (and the engine) goes with it.
    engines = _engines(stack)
    assert len(engines) == 1
    children = [p for p in stack.leftovers() if p.pid != first_pid]
    assert len(children) >= 7, children
    stack.process.kill()
    stack.process.wait()
    killed_at = time.monotonic()
    wait_for(lambda: not stack.leftovers(), 40, "no process of the killed stack to survive")
    print(f"all children gone {time.monotonic() - killed_at:.1f} s after kill -9 of the launcher")

    # A new up takes the directory over cleanly.
    key = stack.start()["API key"]
    assert redis.Redis(unix_socket_path=str(socket_path)).ping()
    started = api.post(f"/api/models/{model_id}/start")
    assert started.status_code == 202, started.text
    wait_for(lambda: _serves(stack, key), 90, "/v1 on the new stack")
    assert len(_engines(stack)) == 1

    # kill -9 of the agent, then stop up at once: the engine is stopped all the same.
    engine = _engines(stack)[0].pid
    psutil.Process(stack.pid("agent")).kill()
    assert stack.stop() == 0
    wait_for(lambda: not stack.leftovers(), 30, "every process, engine included, to exit")
    # Stopped by up from the agent's records, not by a restarted agent.
    assert f"the agent left running: pids [{engine}]" in "\n".join(stack.lines), stack.lines
