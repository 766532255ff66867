"""Processes the benchmark starts, and stopping every one of them, by pid.

Each child gets its own session (``start_new_session``), so a Ctrl-C in the terminal
reaches only the benchmark, which then stops the children itself, in reverse order:
SIGTERM to the child's process group, a grace period, then SIGKILL. Only groups led by
a pid this module started are signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def http_status(url: str, *, headers: dict[str, str] | None = None, timeout: float = 3.0) -> int:
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 - loopback only
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError, ValueError):
        return 0


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)
    grace: float = 10.0

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Processes:
    """Every child of this run; :meth:`stop_all` is safe to call more than once."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        grace: float = 10.0,
        stdout: int | None = None,
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name=name, argv=argv, log_path=self.log_dir / f"{name}.log", grace=grace)
        child.log = open(child.log_path, "ab")  # closed in stop()
        child.popen = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else child.log,
            stderr=child.log if stdout is None else subprocess.STDOUT,
            start_new_session=True,
        )
        self.children.append(child)
        return child

    def stop(self, child: Child) -> None:
        popen = child.popen
        if popen is not None and popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGTERM)
            try:
                popen.wait(timeout=child.grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=5)
        elif popen is not None:
            # The leader is gone; anything it left in its own group goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGKILL)
        if child.log is not None:
            child.log.close()
            child.log = None

    def stop_all(self) -> None:
        for child in reversed(self.children):
            with contextlib.suppress(Exception):
                self.stop(child)


def wait_until(
    ready: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    child: Child | None = None,
    interval: float = 0.25,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if child is not None and not child.alive():
            raise RuntimeError(
                f"{what}: {child.name} exited with code {child.popen.returncode if child.popen else None}; "
                f"its log ({child.log_path}) ends with:\n{child.tail()}"
            )
        time.sleep(interval)
    tail = f"; its log ({child.log_path}) ends with:\n{child.tail()}" if child else ""
    raise RuntimeError(f"{what} did not answer within {timeout:.0f} s{tail}")


def kill_pids(pids: dict[int, float]) -> list[int]:
    """SIGKILL the pids still running with the same creation time; returns those killed."""
    killed = []
    for pid, created in pids.items():
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) > 0.01:
                continue
            proc.kill()
            killed.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


def cpu_by_process(procs: list[psutil.Process]) -> dict[str, float]:
    """user + system seconds of each of these processes, keyed by its command's name
    (the web server, the agent: where a path's CPU goes)."""
    out: dict[str, float] = {}
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            cmd = proc.cmdline()
            name = Path(next((a for a in cmd[1:] if not a.startswith("-")), proc.name())).name
            if "uvicorn" in cmd or any("asgi" in a for a in cmd):
                name = "web"
            elif "agent" in cmd:
                name = "agent"
            times = proc.cpu_times()
            key = name if name not in out else f"{name} {proc.pid}"
            out[key] = times.user + times.system
    return out


def cpu_seconds(procs: list[psutil.Process], *, children: bool = False) -> float:
    """user + system seconds of these processes (and, optionally, their live descendants)."""
    total = 0.0
    seen: set[int] = set()
    for proc in procs:
        group = [proc]
        if children:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                group += proc.children(recursive=True)
        for member in group:
            if member.pid in seen:
                continue
            seen.add(member.pid)
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                times = member.cpu_times()
                total += times.user + times.system
    return total


def _is_kernel_thread(proc: psutil.Process) -> bool:
    return proc.pid == 2 or proc.ppid() == 2


def foreign_snapshot() -> dict[int, tuple[float, float]]:
    """{pid: (create time, cpu s)} of the processes this run did not start.

    Ours are this process and all its descendants (every child is started from here,
    and the engine is the agent's child); kernel threads are left out too (they carry
    the loopback traffic of the run itself).
    """
    me = psutil.Process()
    ours = {me.pid}
    with contextlib.suppress(psutil.Error):
        ours |= {p.pid for p in me.children(recursive=True)}
    out: dict[int, tuple[float, float]] = {}
    for proc in psutil.process_iter(["create_time", "cpu_times"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if proc.pid in ours or _is_kernel_thread(proc):
                continue
            times = proc.info["cpu_times"]
            out[proc.pid] = (proc.info["create_time"], times.user + times.system)
    return out


def foreign_seconds(before: dict[int, tuple[float, float]]) -> float:
    """CPU seconds the processes we did not start used since ``before`` was taken."""
    total = 0.0
    for pid, (created, cpu) in foreign_snapshot().items():
        then = before.get(pid)
        total += cpu - then[1] if then and abs(then[0] - created) < 0.01 else cpu
    return max(0.0, total)
