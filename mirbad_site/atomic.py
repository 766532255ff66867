"""Crash-safe file writes for the master's state files.

A state file is written to a temp file in the same directory, fsynced,
renamed over the target and the directory fsynced, so a crash leaves either
the old or the new content and never half of one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, mode: int = 0o600, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` atomically with ``mode``.

    With ``exclusive`` an existing file is left alone and ``FileExistsError``
    raised, so two processes racing to create a once-only file (the secret
    key, the CA) agree on one winner.
    """
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if exclusive:
            # link() fails if the target exists, unlike rename().
            os.link(tmp_name, path)
            os.unlink(tmp_name)
        else:
            os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
