"""Crash-safe file writes, for the master's state files and the agent's alike.

Every state file (the master's ``master.json``, CA and secrets; the agent's identity,
``processes.json``, manifests) goes through :func:`write_atomic`: a temp file in the same
directory, fsynced, renamed over the target, and the directory fsynced, so a crash or
power loss leaves either the old file or the new one, never a torn mix. On Linux the
rename itself is only durable once its directory entry is, hence the last fsync.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["fsync_directory", "write_atomic"]


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush a directory entry so a rename into it survives a crash."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes,
    mode: int = 0o600,
    *,
    exclusive: bool = False,
    parents: bool = False,
) -> None:
    """Replace ``path`` with ``data`` atomically, with permissions ``mode``.

    The temporary file lives in the same directory (a rename across file systems is
    not atomic) and gets its mode before any byte is written, so a secret is never
    readable by others, not even briefly. With ``parents`` a missing parent directory
    is created private (0700); without, a missing one raises FileNotFoundError (the
    agent's state directories are made with their modes on purpose). With ``exclusive`` an existing file is left alone and
    ``FileExistsError`` raised, so two processes racing to create a once-only file
    (the secret key, the CA) agree on one winner. Raises OSError; callers decide
    whether that is fatal.
    """
    target = Path(path)
    if parents:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            fd = -1
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if exclusive:
            # link() fails if the target exists, unlike rename().
            os.link(tmp_name, target)
            os.unlink(tmp_name)
        else:
            os.replace(tmp_name, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_directory(target.parent)
