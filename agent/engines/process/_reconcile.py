"""Telling our engines from everyone else's after an agent restart (adoption and orphans).

A restarted agent finds the records of its previous run in ``processes.json``. Whether
a live process is one of them is decided only from facts the kernel reports, never from
a process name:

- the pid, and the process creation time psutil reads for it (within 0.5 s of the
  recorded one: a pid reused by a later process has a later creation time);
- the program: ``/proc/{pid}/exe`` resolved. For an interpreted engine (a ``#!``
  script, like the tests' fake llama-server) the kernel reports the interpreter there
  and puts the script's path right after it in the command line; the program is then
  that script;
- the argv digest: SHA-256 of the command line read back, from the program on, which
  must equal the digest of the substituted argv the agent recorded before starting it.

Only processes whose program lies in one of the configured executables' folders (the
"runtimes folders") are ever considered ours; anything else is left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "CREATE_TIME_TOLERANCE",
    "Finding",
    "Observed",
    "argv_digest",
    "is_under",
    "matches_record",
    "observe",
    "scan",
    "stop_group",
]

log = logging.getLogger("mirbad.agent.process")

CREATE_TIME_TOLERANCE = 0.5
# psutil derives creation times from the boot time, which /proc/stat gives in whole
# seconds; a process started just after a pending record can thus read up to ~1 s
# earlier than the time.time() written into that record.
PENDING_CLOCK_SLACK = 1.0


def argv_digest(argv: Sequence[str]) -> str:
    """``sha256:`` + hex SHA-256 of the argv joined by NUL (as /proc/{pid}/cmdline holds it)."""
    return "sha256:" + hashlib.sha256("\0".join(argv).encode()).hexdigest()


@dataclass(frozen=True)
class Observed:
    """What the kernel says about one live process."""

    pid: int
    create_time: float
    exe: str
    program: Path
    argv: tuple[str, ...]
    cmdline: tuple[str, ...]

    @property
    def digest(self) -> str:
        return argv_digest(self.argv)


def is_under(path: Path, folders: Iterable[Path]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def _is_script(path: str) -> bool:
    """Whether ``path``, an argument of some process on this machine, is a ``#!`` file.

    The path comes from another process's argv: ``/dev/fd/3`` or ``/proc/self/...``
    there name this process's own descriptors here (reading one stole bytes from a pipe
    and hung a scan), and a FIFO or a device can block on open or read. Only a regular
    file, opened without blocking, can be a script.
    """
    if path.startswith(("/dev/", "/proc/")):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 2) == b"#!"
    except OSError:
        return False
    finally:
        os.close(fd)


def _program(exe: Path, cmdline: list[str], targets: Iterable[Path]) -> tuple[Path, list[str]]:
    targets = list(targets)
    if exe in targets or is_under(exe, targets) or len(cmdline) < 2:
        return exe, cmdline
    script = cmdline[1]
    if os.path.isabs(script) and _is_script(script):
        return Path(script).resolve(), cmdline[1:]
    return exe, cmdline


def observe(pid: int | psutil.Process, targets: Iterable[Path] = ()) -> Observed | None:
    """The live process ``pid``, or None if it is gone, a zombie or unreadable.

    ``targets`` are executables or folders the caller cares about: an exe that lies
    among them is taken as the program even if its argv[1] happens to be a script.
    """
    try:
        proc = pid if isinstance(pid, psutil.Process) else psutil.Process(pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            exe = proc.exe()
            cmdline = proc.cmdline()
            create_time = proc.create_time()
    except (psutil.Error, OSError):
        return None
    if not exe:
        return None  # a kernel thread
    resolved = Path(exe).resolve()
    program, argv = _program(resolved, cmdline, targets)
    return Observed(
        pid=proc.pid,
        create_time=create_time,
        exe=exe,
        program=program,
        argv=tuple(argv),
        cmdline=tuple(cmdline),
    )


def matches_record(obs: Observed, record: dict[str, Any]) -> bool:
    """Whether ``obs`` is the process ``record`` describes (creation time, program, argv)."""
    try:
        recorded_time = float(record["pidCreateTime"])
        recorded_program = Path(record["executablePath"])
    except (KeyError, TypeError, ValueError):
        return False
    if abs(obs.create_time - recorded_time) > CREATE_TIME_TOLERANCE:
        return False
    if obs.program != recorded_program:
        return False
    # object, not Any: a record read from disk may hold anything under this key.
    digest: object = record.get("argvDigest")
    if digest:
        return obs.digest == digest
    # A record of an agent that did not keep the digest: its exact command line.
    cmdline = record.get("pidCmdline")
    return bool(cmdline) and list(obs.cmdline) == cmdline


@dataclass(frozen=True)
class Pending:
    """A record written just before a start whose outcome was never recorded."""

    instance_id: str
    digest: str
    since: float


@dataclass(frozen=True)
class Finding:
    """A process the scan looked at: ``instance_id`` set when it is provably ours."""

    obs: Observed
    instance_id: str | None
    why: str


def _listeners(ports: Iterable[int]) -> dict[int, set[int]]:
    """pid -> ports among ``ports`` it listens on (TCP)."""
    wanted = set(ports)
    found: dict[int, set[int]] = {}
    if not wanted:
        return found
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError) as exc:
        log.warning("Cannot list listening sockets (%s); ports are not checked for orphans", exc)
        return found
    for conn in connections:
        if (
            conn.status == psutil.CONN_LISTEN
            and conn.laddr
            and conn.laddr.port in wanted
            and conn.pid is not None
        ):
            found.setdefault(conn.pid, set()).add(conn.laddr.port)
    return found


def scan(
    *,
    folders: Sequence[Path],
    pending: Sequence[Pending],
    ports: dict[int, str],
    skip: set[int],
) -> list[Finding]:
    """Every process of interest after adoption (blocking: run it in a thread).

    - program under ``folders`` and argv digest of a pending record, created after the
      record was written: ours (``why`` = ``pending``);
    - listening on one of ``ports`` (port -> instance id), program under ``folders``
      and the port among its arguments: ours (``why`` = ``port``);
    - program under ``folders`` or holding one of ``ports``, otherwise: foreign
      (``instance_id`` None), to be left alone.
    """
    listeners = _listeners(ports)
    findings: list[Finding] = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        held = listeners.get(proc.pid, set())
        obs = observe(proc, folders)
        if obs is None:
            continue
        ours = is_under(obs.program, folders)
        if not ours and not held:
            continue
        owner: Finding | None = None
        if ours:
            for record in pending:
                if obs.digest == record.digest and obs.create_time >= (
                    record.since - PENDING_CLOCK_SLACK
                ):
                    owner = Finding(obs, record.instance_id, "pending")
                    break
            if owner is None:
                for port in sorted(held):
                    if str(port) in obs.argv:
                        owner = Finding(obs, ports[port], "port")
                        break
        findings.append(owner or Finding(obs, None, "foreign"))
    return findings


def stop_group(obs: Observed, grace: float) -> bool:
    """SIGTERM the process group ``obs`` leads (or only it), SIGKILL after ``grace`` s.

    Blocking. The pid is checked again first: the signal goes out only while a process
    with the observed creation time holds it. Returns whether it was signalled.
    """
    try:
        proc = psutil.Process(obs.pid)
        if abs(proc.create_time() - obs.create_time) > CREATE_TIME_TOLERANCE:
            return False
        leads_group = os.getpgid(obs.pid) == obs.pid
    except (psutil.Error, OSError):
        return False

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if leads_group:
                os.killpg(obs.pid, sig)
            else:
                os.kill(obs.pid, sig)

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(proc):
        time.sleep(0.1)
    if _alive(proc) or leads_group:
        send(signal.SIGKILL)
    return True


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
