"""Kill a forked writer with SIGKILL at one step of write_atomic (the crash tests).

The child wraps the ``os`` functions the helper calls, in its own process only: the
real system call runs, then the kill, so the shipped code is what is exercised, with
no hook inside it. ``temp-written`` dies just before the temp file's fsync.
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Callable
from typing import Any

# Before the rename: the old content stays. After it: the new content is in place.
OLD_STEPS = ("temp-written", "temp-fsynced")
NEW_STEPS = ("renamed", "dir-fsynced")
STEPS = OLD_STEPS + NEW_STEPS


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(step: str) -> None:
    """In a forked child: SIGKILL this process at ``step`` of its next write_atomic
    (one of :data:`STEPS`, or ``linked`` for an exclusive create)."""
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd: Any) -> None:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        if step == "temp-written" and not is_dir:
            die()
        real_fsync(fd)
        if (step == "temp-fsynced" and not is_dir) or (step == "dir-fsynced" and is_dir):
            die()

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if step == "renamed":
            die()

    def link(src: Any, dst: Any) -> None:
        real_link(src, dst)
        if step == "linked":
            die()

    # This process's own os module: it dies right after.
    os.fsync, os.replace, os.link = fsync, replace, link


def in_killed_child(work: Callable[[], object]) -> None:
    """Run ``work`` in a forked child; assert that the child died of SIGKILL (the step
    was reached, not skipped)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            work()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"the writer was not killed (wait status {status})"
    )
