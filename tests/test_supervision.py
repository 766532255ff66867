"""``./mirbad up``'s supervision, lock and health, without starting the whole stack.

The real-process checks (kill -9 of each child, of the launcher) are in
tests/e2e/test_up_supervision.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from django.test import Client

from core import supervision
from core.config import load_master_config
from mirbad_site import launcher, stack_lock
from nodes import monitor, status_cache


def test_backoff_doubles_to_30_s_and_resets_after_a_stable_run() -> None:
    backoff = supervision.Backoff()
    delays = [backoff.next(uptime=2.0) for _ in range(7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.next(uptime=supervision.STABLE_AFTER) == 1.0
    assert backoff.next(uptime=0.5) == 2.0


def test_exit_wording() -> None:
    assert supervision.describe_exit(-9) == "signal SIGKILL (-9)"
    assert supervision.describe_exit(3) == "code 3"
    assert supervision.describe_exit(None) == "an unknown status"


def test_restart_lines_from_the_status_file(tmp_path: Path) -> None:
    assert supervision.restart_lines(tmp_path) == []
    supervision.write_status(
        tmp_path,
        123,
        {
            "web": supervision.ChildRecord(pid=10),
            "monitor": supervision.ChildRecord(
                pid=11, restarts=2, last_exit=-9, last_restart_at=1_796_157_065.0
            ),
            "agent": supervision.ChildRecord(pid=None, restarts=1, last_exit=1, restarting_at=1.0),
        },
    )
    assert json.loads((tmp_path / supervision.STATUS_FILE).read_text())["launcherPid"] == 123
    assert supervision.restart_lines(tmp_path) == [
        "agent restarted 1 time (exit 1); restarting now",
        "monitor restarted 2 times, last at 2026-12-01 20:31:05 UTC (exit -9)",
    ]
    (tmp_path / supervision.STATUS_FILE).write_text("{half")
    assert supervision.restart_lines(tmp_path) == []


# -- the lock -------------------------------------------------------------------------


def _launcher(data: Path) -> launcher.Launcher:
    config = load_master_config({"MIRBAD_DATA_PATH": str(data)})
    return launcher.Launcher(config=config, demo=False)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[launcher.Launcher]:
    first = _launcher(tmp_path / "var")
    first.lock()
    yield first
    first.stop_all()


def test_a_second_up_is_refused_with_the_pid_of_the_first(
    held: launcher.Launcher, tmp_path: Path
) -> None:
    with pytest.raises(launcher.LaunchError, match=rf"\(pid {os.getpid()}\) is running"):
        _launcher(tmp_path / "var").lock()


def test_the_lock_stays_held_by_children_and_is_taken_over_once_they_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "var"
    data.mkdir()
    # A dead launcher's lock file and a child that inherited its descriptor.
    fd = os.open(data / stack_lock.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": 999_999_999, "createTime": 1.0}).encode())
    child = subprocess.Popen(["sleep", "2"], pass_fds=(fd,))
    os.close(fd)
    try:
        monkeypatch.setattr(stack_lock, "TAKEOVER_WAIT", 0.5)
        with pytest.raises(launcher.LaunchError, match=rf"still hold .*pids \[{child.pid}\]"):
            _launcher(data).lock()
        monkeypatch.setattr(stack_lock, "TAKEOVER_WAIT", 20.0)
        second = _launcher(data)
        second.lock()  # waits for the child, then takes over
        assert child.poll() is not None
        holder = json.loads((data / stack_lock.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        second.stop_all()
    finally:
        child.kill()
        child.wait()


def test_children_inherit_the_lock_and_die_with_the_launcher(tmp_path: Path) -> None:
    """A launcher killed with -9: its child gets SIGTERM from the kernel (Linux)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(launcher.ROOT))!r})
from pathlib import Path
from mirbad_site.launcher import Launcher
from core.supervision import Child
from core.config import load_master_config
up = Launcher(config=load_master_config({{"MIRBAD_DATA_PATH": {str(tmp_path / "var")!r}}}), demo=False)
up.lock()
child = Child(name="sleeper", argv=["sleep", "60"], log_path=Path({str(tmp_path)!r}) / "s.log")
up.children.append(child)
up._spawn(child)
print(child.process.pid, flush=True)
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert (tmp_path / "var" / "run" / "sleeper.pid").read_text() == str(pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)
        assert not _running(pid), "the child outlived a launcher killed with -9"
    finally:
        parent.kill()
        parent.wait()


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_redis_socket_that_answers_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "r.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(64)
            conn.sendall(b"+PONG\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    up = _launcher(tmp_path / "var")
    up.config = replace(up.config, redis_url=f"unix://{path}")
    try:
        with pytest.raises(launcher.LaunchError, match="still answers"):
            up._clear_redis_socket()
        assert path.exists()
    finally:
        server.close()
    up._clear_redis_socket()  # nothing answers now: a stale file, removed
    assert not path.exists()


# -- /healthz, the monitor's heartbeat and the console --------------------------------


@pytest.fixture
def no_heartbeat(status_redis):  # type: ignore[no-untyped-def]
    status_redis.delete(monitor.HEARTBEAT_KEY)
    yield status_redis
    status_redis.delete(monitor.HEARTBEAT_KEY)


@pytest.mark.django_db
def test_healthz_reports_a_missing_or_stale_monitor(no_heartbeat) -> None:  # type: ignore[no-untyped-def]
    client = Client()
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["monitor"] == "missing"
    no_heartbeat.set(monitor.HEARTBEAT_KEY, repr(time.time() - 40))
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 503, body
    assert body["monitor"] == "stale" and body["database"] == body["redis"] == "ok"
    assert 39 <= body["monitorBeatAgeSeconds"] <= 60
    no_heartbeat.set(monitor.HEARTBEAT_KEY, repr(time.time()))
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json()["monitor"] == "ok"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after")
async def test_the_monitor_beats_at_every_step(no_heartbeat) -> None:  # type: ignore[no-untyped-def]
    mon = monitor.Monitor(refresh_interval=0.05)
    task = asyncio.create_task(mon.run())
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and no_heartbeat.get(monitor.HEARTBEAT_KEY) is None:
            await asyncio.sleep(0.05)
        first = monitor.heartbeat_age()
        assert first is not None and first < 2
        await asyncio.sleep(0.3)
        assert float(no_heartbeat.get(monitor.HEARTBEAT_KEY)) > time.time() - 0.3
    finally:
        mon.stop.set()
        await task
    await status_cache.async_client().aclose()


def test_the_overview_shows_restarts(operator, settings, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings.MIRBAD = replace(settings.MIRBAD, data_path=tmp_path)
    client = Client()
    client.force_login(operator)
    assert 'id="restarts"' not in client.get("/").content.decode()
    supervision.write_status(
        tmp_path / "run",
        1,
        {"monitor": supervision.ChildRecord(restarts=2, last_exit=-9, last_restart_at=0.0)},
    )
    page = client.get("/").content.decode()
    assert "monitor restarted 2 times, last at 1970-01-01 00:00:00 UTC (exit -9)" in page


def test_a_killed_launcher_not_yet_reaped_does_not_hold_the_directory() -> None:
    import psutil

    proc = subprocess.Popen(["sleep", "60"])
    holder = {"pid": proc.pid, "createTime": psutil.Process(proc.pid).create_time()}
    try:
        assert stack_lock.same_process(holder)
        assert not stack_lock.same_process({**holder, "createTime": holder["createTime"] - 5})
        proc.kill()
        deadline = time.monotonic() + 5
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not stack_lock.same_process(holder), "a zombie is a dead launcher"
    finally:
        proc.kill()
        proc.wait()


def test_a_child_that_exits_is_restarted_after_its_back_off(tmp_path: Path) -> None:
    up = _launcher(tmp_path / "var")
    up.lock()
    child = supervision.Child(name="short", argv=["sleep", "0.1"], log_path=tmp_path / "short.log")
    up.children.append(child)
    try:
        up._spawn(child)
        first = child.record.pid
        assert child.process is not None
        child.process.wait()
        up._supervise_one(child)  # notes the exit, schedules the restart 1 s out
        assert child.restart_at is not None and child.record.restarts == 0
        up._supervise_one(child)  # too early: nothing happens
        assert child.record.pid == first
        child.restart_at = time.monotonic()
        up._supervise_one(child)
        assert child.record.pid != first and child.record.restarts == 1
        assert child.record.last_exit == 0
        assert (tmp_path / "var" / "run" / "short.pid").read_text() == str(child.record.pid)
        assert supervision.restart_lines(up.config.run_dir)[0].startswith(
            "short restarted 1 time, last at "
        )
        log = (tmp_path / "short.log").read_text()
        assert "mirbad: short exited with code 0" in log and "restarting it in 1 s" in log
        assert "mirbad: short restarted (pid" in log
    finally:
        up.stop_all()
    assert not (up.config.run_dir / supervision.STATUS_FILE).exists()
