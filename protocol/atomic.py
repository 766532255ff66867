"""Crash-safe file writes, for the master's state files and the agent's alike.

Every state file (the master's secrets, certificate caches, backups, launcher settings;
the agent's identity, ``fencing.json``, ``operations.json``, ``processes.json``,
``containers.json``, ``downloads.json``, manifests) goes through :func:`write_atomic`:

1. a temp file ``.{name}.XXXXXXXX.tmp`` in the same directory (a rename across file
   systems is not atomic), created 0600 and given its final mode before any byte is
   written, so a secret is never readable by others, not even briefly;
2. the data written and the temp file fsynced;
3. the temp file renamed over the target (or, ``exclusive``, hard-linked to it);
4. the directory fsynced: on Linux the rename is only durable once its entry is.

A crash at any point leaves either the whole old file or the whole new one
(tests/protocol/test_atomic_crash.py kills a writer at each step). A writer killed
before step 3 leaves its temp file behind; the next write of the same target removes
it. Each writer holds an ``flock`` on its temp file until the rename, so only a dead
writer's temp file is ever removed, never one another process is still writing.

An fsync that fails raises :class:`AtomicWriteError` at once, naming the file, and is
never retried: after a failed fsync Linux may mark the lost pages clean, so a second
fsync could report success for data that never reached the disk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import tempfile
from pathlib import Path

__all__ = ["AtomicWriteError", "fsync_directory", "write_atomic"]

# mkstemp's random part: 8 characters of this set (tempfile._RandomNameSequence).
_RANDOM = re.compile(r"^[a-z0-9_]{8}$")
_SUFFIX = ".tmp"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


class AtomicWriteError(OSError):
    """A state file could not be written durably.

    ``str()`` names the file, the step that failed and what is on disk now;
    ``errno``, ``strerror`` and ``filename`` are the system's error's, so a caller that
    catches OSError still does.
    """

    def __init__(self, path: str | os.PathLike[str], step: str, cause: OSError, now: str):
        super().__init__(cause.errno, cause.strerror or str(cause), os.fspath(path))
        self.step = step
        self.now = now

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.step} failed ({self.strerror}); {self.now}"

    def __reduce__(self) -> tuple[type[AtomicWriteError], tuple[str, str, OSError, str]]:
        # Pickled (a worker's result) it must rebuild from its own arguments.
        cause = OSError(self.errno, self.strerror)
        return (AtomicWriteError, (str(self.filename), self.step, cause, self.now))


def _fsync_directory(directory: str | os.PathLike[str]) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush a directory entry so a rename, link or unlink in it survives a crash.

    Raises :class:`AtomicWriteError` naming the directory when the fsync fails.
    """
    try:
        _fsync_directory(directory)
    except OSError as exc:
        raise AtomicWriteError(
            directory, "fsync of the directory", exc, "its last changes may not survive a crash"
        ) from exc


def _temp_names(name: str, entries: list[str]) -> list[str]:
    prefix = f".{name}."
    return [
        e
        for e in entries
        if e.startswith(prefix)
        and e.endswith(_SUFFIX)
        # The exact shape only: ".a.b.XXXXXXXX.tmp" belongs to "a.b", not to "a".
        and _RANDOM.match(e[len(prefix) : -len(_SUFFIX)])
    ]


def _sweep(directory: Path, name: str) -> None:
    """Remove the temp files that dead writers of ``directory/name`` left behind.

    A live writer holds an flock on its temp file until it is renamed away, so a lock
    we get is a dead writer's (the kernel drops a process's locks when it dies).
    """
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in _temp_names(name, entries):
        path = directory / entry
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.fstat(fd)
            seen = os.lstat(path)
            if (held.st_dev, held.st_ino) == (seen.st_dev, seen.st_ino):
                os.unlink(path)
        except OSError:
            pass  # a live writer holds it, or it went away meanwhile
        finally:
            os.close(fd)


def _claim_temp(directory: Path, name: str) -> tuple[int, str]:
    """A fresh temp file, opened and flocked; (descriptor, path)."""
    while True:
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=_SUFFIX)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper holds it for an instant at most
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                # A file system without flock: no sweeper can take it either (its
                # leftovers stay, as they did before the sweep).
                return fd, tmp_name
            held = os.fstat(fd)
            try:
                seen = os.lstat(tmp_name)
            except FileNotFoundError:
                seen = None
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        if seen is not None and (held.st_dev, held.st_ino) == (seen.st_dev, seen.st_ino):
            return fd, tmp_name
        # A sweeper took it for a dead writer's between mkstemp and the lock: draw another.
        os.close(fd)


def _make_parents(directory: Path) -> None:
    """Create missing parents (0700) and make each new entry durable."""
    missing = []
    probe = directory
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for made in reversed(missing):
        fsync_directory(made.parent)


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes,
    mode: int = 0o600,
    *,
    exclusive: bool = False,
    parents: bool = False,
) -> None:
    """Replace ``path`` with ``data`` atomically, with permissions ``mode``.

    With ``parents`` a missing parent directory is created private (0700); without,
    a missing one raises FileNotFoundError (the agent's state directories are made with
    their modes on purpose). With ``exclusive`` an existing file is left alone and
    ``FileExistsError`` raised, so two processes racing to create a once-only file (the
    secret key, the CA) agree on one winner.

    A failed write or fsync raises :class:`AtomicWriteError` naming the file; before the
    rename the old file is untouched and the temp file removed. Other failures raise
    the system's OSError (they name their paths). Nothing is retried.
    """
    target = Path(path)
    directory = target.parent
    if parents:
        _make_parents(directory)
    _sweep(directory, target.name)
    fd, tmp_name = _claim_temp(directory, target.name)
    step = "creating the temp file"
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        step = "writing the temp file"
        while view:
            view = view[os.write(fd, view) :]
        step = "fsync of the temp file"
        os.fsync(fd)
        step = "renaming the temp file"
        if exclusive:
            # link() fails if the target exists, unlike rename().
            os.link(tmp_name, target)
            os.unlink(tmp_name)
        else:
            os.replace(tmp_name, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        os.close(fd)
        if isinstance(exc, OSError) and step in ("writing the temp file", "fsync of the temp file"):
            raise AtomicWriteError(target, step, exc, "the old file is kept") from exc
        raise
    os.close(fd)  # the lock goes with it, only now that the temp name is gone
    try:
        _fsync_directory(directory)
    except OSError as exc:
        raise AtomicWriteError(
            target,
            "fsync of the directory",
            exc,
            "the new content is in place but may not survive a power loss",
        ) from exc
