"""Crash-safe file writes.

Every state file of the agent (identity, processes.json, manifests) goes through
:func:`write_atomic`, so a crash or power loss leaves either the old file or the new
one, never a torn mix. The directory is fsynced after the rename because on Linux the
rename itself is only durable once its directory entry is.
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


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically, with permissions ``mode``.

    The temporary file lives in the same directory (a rename across file systems is
    not atomic) and gets its mode before any byte is written, so a secret is never
    readable by others, not even briefly. Raises OSError; callers decide whether that
    is fatal.
    """
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            fd = -1
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_directory(target.parent)
