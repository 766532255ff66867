"""How ``./mirbad up`` restarts what dies, and the status file the console reads.

Django-free: the launcher imports it before Django is set up. A child that
exits while ``up`` runs is started again after a back-off (1 s doubling to
30 s; a child that stayed up 60 s starts again at 1 s). Every restart is
recorded in ``<data>/run/supervision.json``, written atomically, which the
console's overview turns into one line per restarted process. A child's output
goes to ``<data>/logs/<name>.log`` (O_APPEND), which the launcher caps while it
runs (:meth:`Child.cap_log`, protocol/logcap.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from protocol.atomic import write_atomic
from protocol.logcap import Capped, LogLimits, copy_truncate

BACKOFF_START = 1.0
BACKOFF_MAX = 30.0
# A child that stayed up this long is taken as healthy again: its next crash waits 1 s.
STABLE_AFTER = 60.0
STATUS_FILE = "supervision.json"


def describe_exit(code: int | None) -> str:
    """``code 3`` or ``signal SIGKILL (-9)``, as Popen.returncode reports it."""
    if code is None:
        return "an unknown status"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name} ({code})"
        return f"signal {-code} ({code})"
    return f"code {code}"


@dataclass
class Backoff:
    """The delay before the next restart of one child."""

    delay: float = BACKOFF_START

    def next(self, uptime: float) -> float:
        """The delay to wait now, given how long the child ran before it exited."""
        if uptime >= STABLE_AFTER:
            self.delay = BACKOFF_START
        delay = self.delay
        self.delay = min(self.delay * 2, BACKOFF_MAX)
        return delay


@dataclass
class ChildRecord:
    """What the status file says about one child."""

    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    last_restart_at: float | None = None  # epoch seconds
    restarting_at: float | None = None  # epoch seconds, while a restart is pending

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "restarts": self.restarts,
            "lastExit": self.last_exit,
            "lastRestartAt": self.last_restart_at,
            "restartingAt": self.restarting_at,
        }


def write_status(run_dir: Path, launcher_pid: int, children: dict[str, ChildRecord]) -> None:
    """Replace the status file (atomically: the console never reads half of one)."""
    body = {
        "launcherPid": launcher_pid,
        "updatedAt": time.time(),
        "children": {name: record.to_json() for name, record in children.items()},
    }
    write_atomic(
        run_dir / STATUS_FILE, json.dumps(body, indent=1).encode(), mode=0o644, parents=True
    )


def clear_status(run_dir: Path) -> None:
    """Remove the status file: a stopped ``up`` restarts nothing."""
    (run_dir / STATUS_FILE).unlink(missing_ok=True)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """The status file's content, or None when there is none or it is unreadable."""
    try:
        data = json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def restart_lines(run_dir: Path) -> list[str]:
    """One line per child restarted since ``up`` started, e.g. for the console.

    ``monitor restarted 2 times, last at 2026-12-01 20:31:05 UTC (exit -9)``.
    """
    data = read_status(run_dir)
    children = (data or {}).get("children")
    if not isinstance(children, dict):
        return []
    lines = []
    for name, record in sorted(children.items()):
        if not isinstance(record, dict):
            continue
        restarts = record.get("restarts")
        if not isinstance(restarts, int) or restarts <= 0:
            continue
        times = "time" if restarts == 1 else "times"
        line = f"{name} restarted {restarts} {times}"
        last = record.get("lastRestartAt")
        if isinstance(last, int | float):
            moment = dt.datetime.fromtimestamp(last, dt.UTC)
            line += f", last at {moment:%Y-%m-%d %H:%M:%S} UTC"
        code = record.get("lastExit")
        if isinstance(code, int):
            line += f" (exit {code})"
        if isinstance(record.get("restartingAt"), int | float):
            line += "; restarting now"
        lines.append(line)
    return lines


# -- the processes --------------------------------------------------------------------

PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with(parent: int) -> None:
    """In the forked child, before exec: SIGTERM when the launcher dies, however it dies."""
    assert _PRCTL is not None
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


@dataclass
class Child:
    """One process ``up`` started and supervises: its command, log and restart state."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)
    log_offset: int = 0
    started_at: float = 0.0  # monotonic
    restart_at: float | None = None  # monotonic, while a restart waits out its back-off
    backoff: Backoff = field(default_factory=lambda: Backoff())
    record: ChildRecord = field(default_factory=lambda: ChildRecord())
    cwd: Path | None = None

    def start(self, env: dict[str, str], keep_fds: tuple[int, ...] = ()) -> None:
        """Start (or start again) the process; ``keep_fds`` are inherited (the lock)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.log is not None:
            self.log.close()
        self.log = open(self.log_path, "ab")
        self.log_offset = self.log.tell()
        # PDEATHSIG follows the thread that forks: children are spawned from the main one.
        preexec = functools.partial(_die_with, os.getpid()) if _PRCTL is not None else None
        self.process = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: Ctrl-C reaches it only through us
            pass_fds=keep_fds,
            preexec_fn=preexec,  # only prctl and getppid run there: no lock is taken
        )
        self.started_at = time.monotonic()
        self.restart_at = None
        self.record.pid = self.process.pid
        self.record.restarting_at = None

    def log_line(self, line: str) -> None:
        """A line of the launcher's own in this child's log, between the child's lines."""
        if self.log is not None:
            with contextlib.suppress(OSError):
                self.log.write(f"mirbad: {line}\n".encode())
                self.log.flush()

    def cap_log(self, limits: LogLimits) -> Capped | str | None:
        """Copy-truncate the log past ``limits``: what was done, an error text, or None.

        The child writes through its own O_APPEND descriptor, so it goes on at the new
        end; a line in the log says where the earlier lines went.
        """
        try:
            done = copy_truncate(self.log_path, limits)
        except OSError as exc:
            return f"{self.log_path}: {exc.strerror or exc}"
        if done is None:
            return None
        self.log_offset = 0
        kept = f"earlier lines are in {done.rotated.name}" if done.rotated else done.reason
        self.log_line(f"the log passed {limits.max_bytes} bytes and was cut; {kept or 'not kept'}")
        return done

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def new_output(self) -> str:
        """What this run of the child has logged so far (earlier runs excluded)."""
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(self.log_offset)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.new_output().splitlines()[-lines:])
