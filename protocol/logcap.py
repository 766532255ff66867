"""Logs that do not fill a disk: copy-and-truncate at a size limit, a few rotated files kept.

The files capped here are a process's output held open by its writer: an engine's
stdout and stderr (the agent's ``{StateDirectory}/logs/ss-<instance>.log``) and every
process ``./mirbad up`` starts (``<data>/logs/<name>.log``). Such a file cannot be
renamed away, because the writer would go on writing into the renamed file; so its
bytes are copied to ``<name>.1`` and the file is truncated in place. Every writer opens
it with O_APPEND, so its next write lands at the new end (offset 0) and leaves no hole.

The rotated files are ``<name>.1`` (the newest) up to ``<name>.<files>``; older ones are
deleted, so a log never takes more than ``max_bytes * (files + 1)`` plus what its writer
adds between two checks. What the writer adds between the last read of the copy and the
truncation is lost (microseconds: the copy catches up just before the cut).

A full disk must not keep a log from being capped: when the copy fails for lack of
space the file is truncated anyway, without a copy (the last lines were a reader's only
loss; a full disk stops every state write of the process). Used by the agent
(``agent.engines.cap_log``) and the launcher (``core.supervision``); no logging here,
the callers say what happened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NO_SPACE", "Capped", "LogLimits", "copy_truncate", "rotated_name"]

# The errors of a write that did not fit: no space left, or the user's quota spent.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
_COPY_BLOCK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class LogLimits:
    """When to cap (``max_bytes``) and how many rotated files to keep (0: none)."""

    max_bytes: int
    files: int


@dataclass(frozen=True, kw_only=True)
class Capped:
    """What one cap did, so a reader of the file can find the bytes it has not read.

    The bytes ``[start, end)`` of the file as it was are in ``rotated`` (from its
    beginning), and the file was truncated at ``end``. ``rotated`` is None when no copy
    could be kept (``files`` is 0, or the disk was full: then ``reason`` says so).
    """

    rotated: Path | None
    start: int
    end: int
    reason: str | None = None


def rotated_name(path: Path, index: int) -> Path:
    """``ss-x.log`` -> ``ss-x.log.1`` (index 1 is the newest)."""
    return path.with_name(f"{path.name}.{index}")


def copy_truncate(path: Path, limits: LogLimits, *, keep: int | None = None) -> Capped | None:
    """Cap ``path`` once it is larger than ``limits.max_bytes``; None when it was not.

    ``keep`` copies only the file's last ``keep`` bytes (from a line start) into ``.1``;
    None copies all of it. Raises OSError for anything but a full disk (a file that
    cannot be read, a directory that cannot be written): the caller logs it.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size <= limits.max_bytes:
        return None
    if limits.files <= 0:
        return _truncate(path, size, None, None, None)
    # The oldest goes first: on a nearly full disk that is the space the copy needs.
    with contextlib.suppress(FileNotFoundError):
        rotated_name(path, limits.files).unlink()
    staged = path.with_name(path.name + ".1.part")
    try:
        with open(path, "rb") as source:
            start = max(0, size - keep) if keep is not None else 0
            source.seek(start)
            if start:
                start += len(source.readline())  # the cut line's end: .1 starts on a line
            with open(staged, "wb") as target:
                shutil.copyfileobj(source, target, _COPY_BLOCK)  # to the end, as it grows
            for index in range(limits.files - 1, 0, -1):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(rotated_name(path, index), rotated_name(path, index + 1))
            newest = rotated_name(path, 1)
            os.replace(staged, newest)
            copied = source.tell()
            reason = None
            try:
                # Catch up on what was written during the copy, then cut at once.
                with open(newest, "ab") as target:
                    shutil.copyfileobj(source, target, _COPY_BLOCK)
                copied = source.tell()
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                reason = f"the disk is full ({exc.strerror}): the last bytes were not kept"
            return _truncate(path, start, newest, copied, reason)
    except OSError as exc:
        with contextlib.suppress(OSError):
            staged.unlink()
        if exc.errno not in NO_SPACE:
            raise
        reason = f"the disk is full ({exc.strerror}): no copy was kept"
    return _truncate(path, size, None, None, reason)


def _truncate(
    path: Path, start: int, rotated: Path | None, copied: int | None, reason: str | None
) -> Capped:
    """Truncate to 0 (shrinking needs no space).

    ``copied``: where the copy in ``rotated`` ends; None: nothing was copied, and the
    file's size just before the cut is the end.
    """
    fd = os.open(path, os.O_WRONLY)
    try:
        end = os.fstat(fd).st_size if copied is None else copied
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    return Capped(rotated=rotated, start=min(start, end), end=end, reason=reason)
