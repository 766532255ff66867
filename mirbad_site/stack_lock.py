"""One ``./mirbad up`` per data directory: the stack lock and the Redis socket check.

Two stacks on one data directory would fight over the same agent identity, CA,
Redis socket and ports. The lock is an flock on ``up.lock``, whose content names
the launcher that holds it (pid and start time, so a reused pid is not taken for
it). The launcher passes the descriptor to every child, so after a ``kill -9`` of
the launcher the lock stays taken until its last child is gone: a second ``up``
waits for them (on Linux the kernel SIGTERMs them), then takes over, or refuses
naming the pids that still hold it. No Django here: the launcher imports it
before the settings exist.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

LOCK_FILE = "up.lock"
# After a launcher died, its children (SIGTERM'd by the kernel) still hold the lock
# while they stop; the agent may take its engines' stop grace (10 s) and more.
TAKEOVER_WAIT = 45.0


class StackBusy(Exception):
    """Another stack holds the data directory; the message says which pid and what to do."""


def acquire(data_path: Path, *, note: Callable[[str], None]) -> int:
    """Take ``data_path/up.lock`` and write our pid into it; returns the descriptor.

    The descriptor is close-on-exec: the launcher hands it to its children
    explicitly (``pass_fds``). ``note`` prints the one line said while waiting for a
    dead launcher's children. Raises :class:`StackBusy`.
    """
    path = data_path / LOCK_FILE
    data_path.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline: float | None = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        holder = lock_holder(fd)
        pid = holder.get("pid")
        if holder and same_process(holder):
            os.close(fd)
            raise StackBusy(
                f"another './mirbad up' (pid {pid}) is running on {data_path}; "
                f"stop it first (kill {pid}) or set MIRBAD_DATA_PATH to another directory"
            )
        if deadline is None:
            note(
                f"the previous './mirbad up' (pid {pid or 'unknown'}) is gone; waiting up "
                f"to {TAKEOVER_WAIT:.0f} s for the processes it started to exit"
            )
            deadline = time.monotonic() + TAKEOVER_WAIT
        elif time.monotonic() > deadline:
            os.close(fd)
            raise StackBusy(
                f"the previous './mirbad up' (pid {pid or 'unknown'}) is gone, but processes "
                f"it started still hold {path}: pids {holders(path) or 'unknown'}; "
                "stop them first"
            )
        time.sleep(0.5)
    me = psutil.Process()
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": me.pid, "createTime": me.create_time()}).encode(), 0)
    return fd


def lock_holder(fd: int) -> dict[str, Any]:
    """What the launcher holding ``up.lock`` wrote into it ({} while it has not yet)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def same_process(holder: dict[str, Any]) -> bool:
    """Whether the pid in ``holder`` is still that process (a reused pid has a later start)."""
    try:
        proc = psutil.Process(int(holder["pid"]))
        if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped: gone
            return False
        return abs(proc.create_time() - float(holder["createTime"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def holders(path: Path) -> list[int]:
    """Pids that have ``path`` open (those that hold the lock), where we may look."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(f.path == str(path) for f in proc.open_files()):
                found.append(proc.pid)
    return found


def socket_answers(path: str) -> bool:
    """Whether something answers a Redis PING on the unix socket ``path``.

    A socket file that answers belongs to a live Redis and is never removed.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(path)
            sock.sendall(b"PING\r\n")
            return bool(sock.recv(64))
        except OSError:
            return False
