"""Low-level pieces of running an engine process: the process handle, logs, ports.

The process is a plain ``subprocess.Popen`` in its own session (so its whole group can
be signalled), not an asyncio subprocess: asyncio kills its children when the event
loop's transports close, and an agent configured to leave engines running on shutdown
(StopInstancesOnShutdown false) must be able to exit without taking them along. The
exit is observed through a pidfd registered with the event loop (a waiting thread where
pidfds are unavailable).

An engine left running by a previous run of the agent and adopted by this one is an
:class:`AdoptedProcess`: it is not our child, so there is no waitpid; its exit is seen
through a pidfd as well (``pidfd_open`` works for any process on Linux 5.3 and later),
or by polling its pid and creation time every second where pidfds are unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import BinaryIO

import psutil

from agent._errors import SpecRejected
from protocol.logcap import NO_SPACE, Capped, LogLimits, copy_truncate

__all__ = [
    "AdoptedProcess",
    "EngineLogWriter",
    "EngineProcess",
    "PortAllocator",
    "cap_log",
    "engine_log_path",
    "exit_text",
    "open_log",
    "open_pidfd",
    "read_log_tail",
]

log = logging.getLogger("mirbad.agent.process")

LOG_TAIL_LINES = 400
# While an engine runs its log is capped (docs/decisions.md D62; protocol/logcap.py): past
# EngineLogMaxBytes it is copied to ``<name>.1`` (older ones to .2 ... EngineLogFiles)
# and truncated in place. These are the config keys' defaults.
LOG_CAP_BYTES = 32 * 1024 * 1024
LOG_CAP_FILES = 2


def exit_text(code: int | None) -> str:
    """``exited with code 3`` / ``was killed by signal SIGKILL``.

    ``None`` is the exit of an adopted engine: not our child, so its status is unknown.
    """
    if code is None:
        return "exited (exit status unknown: the engine was adopted, not started by this agent)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (any process, not only a child), or None where unavailable."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError, NotImplementedError):
        return None


class _GroupLeader:
    """What both kinds of engine handle share: the exit future and the group kill.

    The engine leads its own process group (it was started in a new session), so the
    group id is its pid.
    """

    pid: int
    _exited: asyncio.Future[int | None]

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    @property
    def exited(self) -> bool:
        return self._exited.done()

    async def wait(self) -> int | None:
        """The exit code once the process has exited (None if unknown, for an adopted one).

        Cancelling this does not kill the process.
        """
        return await asyncio.shield(self._exited)

    def _resolve(self, code: int | None) -> None:
        if not self._exited.done():
            self._exited.set_result(code)

    def kill_leftovers(self) -> None:
        """SIGKILL what is left of the group after the leader exited (helpers it forked)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    async def kill_group(self, grace: float) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace`` s; returns the exit code."""
        pgid = self.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.wait(), grace)
        except TimeoutError:
            log.warning("Process group %s ignored SIGTERM for %g s; killing it", pgid, grace)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            await self.wait()
        # Children that outlived the leader belong to the same group; the kernel does not
        # reuse a pid while its group exists, so this cannot hit someone else's process.
        self.kill_leftovers()
        return await self.wait()


class EngineProcess(_GroupLeader):
    """A started engine: the Popen object plus a future that resolves with its exit code."""

    def __init__(self, *, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._loop = loop
        self._exited = loop.create_future()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
            loop.add_reader(self._pidfd, self._on_pidfd)
        except (AttributeError, OSError, NotImplementedError):
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            threading.Thread(target=self._wait_thread, daemon=True, name=f"wait-{self.pid}").start()

    @classmethod
    def start(
        cls,
        argv: list[str],
        *,
        env: dict[str, str],
        log_file: BinaryIO,
        cwd: Path,
        loop: asyncio.AbstractEventLoop,
    ) -> EngineProcess:
        """Start ``argv`` in a new session, stdin on /dev/null, output on ``log_file``.

        Raises OSError when the executable cannot be started.
        """
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(cwd),
            close_fds=True,
            start_new_session=True,
        )
        return cls(popen=popen, loop=loop)

    def _on_pidfd(self) -> None:
        self._close_pidfd()
        self._resolve(self.popen.wait())

    def _wait_thread(self) -> None:
        code = self.popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop may be gone at agent exit
            self._loop.call_soon_threadsafe(self._resolve, code)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def detach(self) -> None:
        """Stop watching the process and leave it running (agent shutdown)."""
        self._close_pidfd()


class AdoptedProcess(_GroupLeader):
    """An engine a previous run of the agent started, watched without being its parent.

    ``pidfd`` should be opened (:func:`open_pidfd`) *before* the caller verified the
    process's identity, so that it cannot refer to a later process that reused the pid.
    Without one, the pid is polled every ``poll_interval`` s: the engine counts as
    exited once the pid is gone, a zombie, or a process with another creation time.
    """

    def __init__(
        self,
        *,
        pid: int,
        create_time: float,
        pidfd: int | None,
        loop: asyncio.AbstractEventLoop,
        poll_interval: float = 1.0,
    ) -> None:
        self.pid = pid
        self.create_time = create_time
        self._loop = loop
        self._exited = loop.create_future()
        self._pidfd = pidfd
        self._poll_interval = poll_interval
        self._poller: asyncio.Task[None] | None = None
        if pidfd is not None:
            try:
                loop.add_reader(pidfd, self._on_pidfd)
            except (OSError, NotImplementedError, ValueError):
                os.close(pidfd)
                self._pidfd = None
        if self._pidfd is None:
            self._poller = loop.create_task(self._poll(), name=f"watch-{pid}")

    @property
    def watched_by_pidfd(self) -> bool:
        return self._pidfd is not None

    def _on_pidfd(self) -> None:
        self._close_pidfd()
        self._resolve(self._reap())

    def _reap(self) -> int | None:
        # Normally not our child (ECHILD). It still can be, when the agent that started
        # it lives on in the same process (tests do that); then reap it and keep the code.
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return None
        return os.waitstatus_to_exitcode(status) if pid == self.pid else None

    def _gone(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.5:
                return True
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False

    async def _poll(self) -> None:
        # Polling is the point here: nothing signals the exit of a process that is not
        # our child when no pidfd is available.
        while not self._gone():  # noqa: ASYNC110
            await asyncio.sleep(self._poll_interval)
        self._resolve(self._reap())

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def detach(self) -> None:
        """Stop watching the process and leave it running (agent shutdown)."""
        self._close_pidfd()
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None


def read_log_tail(path: Path, offset: int = 0, max_lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``max_lines`` lines written to ``path`` after ``offset``.

    A file shorter than ``offset`` was capped since (truncated in place): all of it is
    this run's output then.
    """
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size < offset:
                offset = 0
            start = max(offset, size - 1024 * 1024)
            handle.seek(start)
            data = handle.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if start > offset and lines:
        lines = lines[1:]  # the first line was cut by the byte window
    return [line.rstrip() for line in lines[-max_lines:]]


def engine_log_path(state_directory: Path, instance_id: str) -> Path:
    """The file an instance's engine writes its output to (``logs/ss-<instanceId>.log``)."""
    return state_directory / "logs" / f"ss-{instance_id}.log"


# Paths whose last cap failed, with the error: a failure is logged once, not every poll.
_CAP_FAILURES: dict[Path, str] = {}


def cap_log(
    path: Path, cap: int = LOG_CAP_BYTES, keep: int | None = None, *, files: int = LOG_CAP_FILES
) -> Capped | None:
    """Copy-truncate ``path`` once it is larger than ``cap``; what it did, or None.

    The engine keeps the file open, so it cannot be renamed away (the engine would go on
    writing to the renamed file). It writes with O_APPEND (:func:`open_log`), so after
    the truncation its next write lands at the new end, offset 0, leaving no hole. The
    file (its last ``keep`` bytes, from a line start, when given) goes to ``<name>.1``
    first, the older ones to ``.2`` ... ``.<files>``; a full disk truncates it without
    a copy (protocol/logcap.py). Never raises: a failure is logged once per path.
    """
    try:
        done = copy_truncate(path, LogLimits(max_bytes=cap, files=files), keep=keep)
    except OSError as exc:
        text = str(exc)
        if _CAP_FAILURES.get(path) != text:
            _CAP_FAILURES[path] = text
            log.warning("Could not cap the engine log %s: %s", path, exc)
        return None
    _CAP_FAILURES.pop(path, None)
    if done is None:
        return None
    if done.reason is not None:
        log.warning("Capped the engine log %s at %d bytes: %s", path, done.end, done.reason)
    else:
        kept = f"now in {done.rotated.name}" if done.rotated else "EngineLogFiles is 0: not kept"
        log.info("Capped the engine log %s at %d bytes (%s)", path, done.end, kept)
    return done


def open_log(path: Path, header: str) -> tuple[BinaryIO, int]:
    """Open for appending (O_APPEND, so a cap never leaves a hole), write a header.

    Returns (file, offset of this run's output). A header that does not fit on a full
    disk is left out: the engine starts all the same, and its own writes fail quietly
    until there is room (the agent's poller caps the file then).
    """
    offset = path.stat().st_size if path.exists() else 0
    # Not a with-block: the caller hands the open file to the child, then closes it.
    # Unbuffered: a header that could not be written is not retried by close().
    handle = open(path, "ab", buffering=0)
    try:
        handle.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {header}\n".encode())
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            handle.close()
            raise
        log.warning("The engine log %s is on a full disk: %s", path, exc.strerror)
    except BaseException:
        handle.close()
        raise
    return handle, offset


class EngineLogWriter:
    """Appends an engine's output that the agent relays (a container's) to its log.

    O_APPEND, unbuffered, like an engine's own descriptor, so a cap never leaves a hole.
    A write that does not fit on a full disk drops that chunk instead of ending the
    relay; once a write fits again, a line says how many bytes were dropped.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.dropped = 0

    def write(self, data: bytes) -> None:
        """Append ``data`` whole, or drop it when the disk is full."""
        if self.dropped:
            note = f"[agent: {self.dropped} bytes of output dropped: the disk was full]\n"
            if self._append(note.encode()):
                self.dropped += len(data)
                return
            self.dropped = 0
        self.dropped += self._append(data)

    def _append(self, data: bytes) -> int:
        """Write ``data``; how many of its bytes did not fit (0: all were written)."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            if not self.dropped:
                log.warning("The engine log %s is on a full disk: %s", self.path, exc.strerror)
            return len(view)
        return 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EngineLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _port_free(port: int) -> bool:
    # No SO_REUSEADDR: the bind must fail if anything listens on this port on 127.0.0.1
    # or the wildcard address.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out loopback ports; the lock keeps two launches off the same free port."""

    def __init__(self, *, start: int, end: int) -> None:
        self._start = start
        self._end = end
        self._taken: set[int] = set()
        self._lock = asyncio.Lock()

    async def reserve(self) -> int:
        async with self._lock:
            for port in range(self._start, self._end + 1):
                if port not in self._taken and _port_free(port):
                    self._taken.add(port)
                    return port
        raise SpecRejected(
            f"no free loopback port in PortRangeStart..PortRangeEnd ({self._start}..{self._end})"
        )

    def claim(self, port: int) -> None:
        """Mark ``port`` as taken (an adopted engine already listens on it)."""
        self._taken.add(port)

    def release(self, port: int | None) -> None:
        if port is not None:
            self._taken.discard(port)
