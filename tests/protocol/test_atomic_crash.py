"""write_atomic under SIGKILL and failing fsyncs: the file is always whole-old or whole-new.

A forked writer arms itself to SIGKILL at one step of the next write (after the temp
file is written, after its fsync, after the rename, after the directory fsync;
tests/crash_support.py): the real system calls run, then the kill, so the helper's
code is exercised as shipped, no hook inside it. After each kill the parent parses the file and checks its checksum, then
writes once more and checks that the dead writer's temp file is gone.

What a SIGKILL proves: a process crash at any step leaves a whole file. What it cannot
prove is a power loss (the page cache survives a killed process); that rests on the
fsync order the same steps follow (docs/security.md, "Crash consistency").
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import select
import signal
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol import atomic
from protocol.atomic import AtomicWriteError, write_atomic
from tests.crash_support import NEW_STEPS, OLD_STEPS, arm, die, in_killed_child

KILLS = int(os.environ.get("MIRBAD_CRASH_KILLS", "100"))  # per step; raise it to run longer
PAYLOAD_CHARS = 64 * 1024  # 16 pages: a torn write would show


class Torn(AssertionError):
    """The file is missing, not JSON, or its checksum does not match."""


def content(version: int) -> bytes:
    """Version ``version`` of the test's state file: JSON with a checksum of its payload."""
    payload = hashlib.sha256(str(version).encode()).hexdigest() * (PAYLOAD_CHARS // 64)
    digest = hashlib.sha256(f"{version}:{payload}".encode()).hexdigest()
    return json.dumps({"version": version, "payload": payload, "sha256": digest}).encode()


def read_version(path: Path) -> int:
    """The version in ``path``; Torn unless the file is whole."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise Torn(f"{path} is missing") from None
    except ValueError as exc:
        raise Torn(f"{path} is not whole JSON ({path.stat().st_size} bytes): {exc}") from None
    digest = hashlib.sha256(f"{doc['version']}:{doc['payload']}".encode()).hexdigest()
    if digest != doc["sha256"] or len(doc["payload"]) != PAYLOAD_CHARS:
        raise Torn(f"{path}: the checksum of version {doc['version']} does not match")
    return int(doc["version"])


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def kill_at(step: str, target: Path, data: bytes, *, exclusive: bool = False) -> None:
    def work() -> None:
        arm(step)
        write_atomic(target, data, mode=0o600, exclusive=exclusive)

    in_killed_child(work)


@pytest.mark.parametrize("step", OLD_STEPS + NEW_STEPS)
def test_a_writer_killed_at_each_step_leaves_a_whole_file(tmp_path: Path, step: str) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, content(0))
    started = time.monotonic()
    for version in range(KILLS):
        kill_at(step, target, content(version + 1))
        found = read_version(target)  # never missing, never torn
        assert found == (version if step in OLD_STEPS else version + 1), (step, version)
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        left = temp_files(tmp_path)
        assert len(left) == (1 if step in OLD_STEPS else 0), left
        # The next write removes the dead writer's temp file.
        write_atomic(target, content(version + 1))
        assert temp_files(tmp_path) == [], step
        assert read_version(target) == version + 1
    print(f"{step}: {KILLS} kills in {time.monotonic() - started:.2f} s")


def test_a_writer_killed_at_random_moments_leaves_a_whole_file(tmp_path: Path) -> None:
    """Between the named steps too: SIGKILL from outside after 0-8 ms of writing."""
    target = tmp_path / "state.json"
    write_atomic(target, content(0))
    rng = random.Random(17)
    versions = [content(v) for v in range(1, 6)]
    base, moved = 0, 0
    for _ in range(KILLS):
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - killed
            try:
                os.close(ready_r)
                write_atomic(target, versions[0])
                # Only now is the kill armed: a busy machine may take longer than the
                # random wait to schedule a fresh child at all.
                os.write(ready_w, b"1")
                while True:
                    for data in versions:
                        write_atomic(target, data)
            finally:
                os._exit(3)
        os.close(ready_w)
        try:
            readable, _, _ = select.select([ready_r], [], [], 30)
            assert readable, "the writer did not finish its first write within 30 s"
            os.read(ready_r, 1)
        finally:
            os.close(ready_r)
        time.sleep(rng.uniform(0, 0.008))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        found = read_version(target)
        assert found in (base, 1, 2, 3, 4, 5)
        moved += found != base
        write_atomic(target, content(0))
        assert temp_files(tmp_path) == []
    # Every kill lands after the first write: each found a newer file than before it.
    assert moved == KILLS, moved
    print(f"random kills: {KILLS}, {moved} found a newer version than before the fork")


@pytest.mark.parametrize("step", ["temp-fsynced", "linked"])
def test_an_exclusive_create_killed_leaves_nothing_or_the_whole_file(
    tmp_path: Path, step: str
) -> None:
    """The once-only files (secret key, CA): absent, or whole, never half a key."""
    for version in range(25):
        target = tmp_path / f"key-{version}"
        kill_at(step, target, content(version), exclusive=True)
        if step == "linked":
            assert read_version(target) == version
        else:
            assert not target.exists()
        assert stat.S_IMODE(os.stat(tmp_path / temp_files(tmp_path)[0]).st_mode) == 0o600
        # A temp file left after the link is a second name of the same inode (0600).
        write_atomic(target, content(version), exclusive=step != "linked")
        assert temp_files(tmp_path) == []


def test_the_check_sees_a_torn_file(tmp_path: Path) -> None:
    """The same kill on a writer that rewrites the file in place: the check catches it
    (the tests above could not pass by a check that never fails)."""
    target = tmp_path / "state.json"
    write_atomic(target, content(0))
    data = content(1)

    def in_place() -> None:
        fd = os.open(target, os.O_WRONLY | os.O_TRUNC)
        os.write(fd, data[: len(data) // 2])
        die()

    in_killed_child(in_place)
    with pytest.raises(Torn, match="not whole JSON"):
        read_version(target)


# -- fsync errors -----------------------------------------------------------------------


@pytest.fixture
def failing_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], list[str]]]:
    """Make the fsync of a file or of a directory fail with EIO; returns the calls seen."""
    real = os.fsync
    calls: list[str] = []

    def arm_fail(kind: str) -> list[str]:
        def fsync(fd: Any) -> None:
            seen = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
            calls.append(seen)
            if seen == kind:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        return calls

    yield arm_fail


def test_a_failing_fsync_stops_the_write_and_keeps_the_old_file(
    tmp_path: Path, failing_fsync: Callable[[str], list[str]]
) -> None:
    target = tmp_path / "fencing.json"
    write_atomic(target, content(0))
    calls = failing_fsync("file")
    with pytest.raises(AtomicWriteError) as caught:
        write_atomic(target, content(1))
    assert caught.value.errno == errno.EIO
    assert str(caught.value) == (
        f"cannot write {target}: fsync of the temp file failed (Input/output error); "
        "the old file is kept"
    )
    assert calls == ["file"]  # once: never retried
    assert read_version(target) == 0
    assert temp_files(tmp_path) == []


def test_a_failing_directory_fsync_is_an_error_not_a_success(
    tmp_path: Path, failing_fsync: Callable[[str], list[str]]
) -> None:
    target = tmp_path / "operations.json"
    write_atomic(target, content(0))
    calls = failing_fsync("dir")
    with pytest.raises(AtomicWriteError, match="may not survive a power loss") as caught:
        write_atomic(target, content(1))
    assert caught.value.filename == str(target)
    assert calls == ["file", "dir"]
    assert read_version(target) == 1  # renamed already: whole, but not known durable


def test_a_failing_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "processes.json"
    write_atomic(target, content(0))

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(AtomicWriteError, match=r"processes\.json: writing the temp file failed"):
        write_atomic(target, content(1))
    monkeypatch.undo()
    assert read_version(target) == 0
    assert temp_files(tmp_path) == []


def test_the_error_survives_pickling() -> None:
    import pickle

    error = AtomicWriteError("/x/state.json", "fsync of the temp file", OSError(5, "EIO"), "kept")
    again = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own bytes
    assert (str(again), again.errno) == (str(error), 5)


def test_fsync_directory_names_the_directory(
    tmp_path: Path, failing_fsync: Callable[[str], list[str]]
) -> None:
    failing_fsync("dir")
    with pytest.raises(AtomicWriteError, match=f"cannot write {tmp_path}: fsync of the dir"):
        atomic.fsync_directory(tmp_path)


# -- modes and leftovers ------------------------------------------------------------------


def test_the_temp_file_is_private_before_any_byte_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: list[int] = []
    real = os.fchmod

    def fchmod(fd: int, mode: int) -> None:
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        assert os.fstat(fd).st_size == 0
        real(fd, mode)

    monkeypatch.setattr(os, "fchmod", fchmod)
    write_atomic(tmp_path / "agent.crt", b"cert", mode=0o644)
    write_atomic(tmp_path / "agent.key", b"key", mode=0o600)
    assert modes == [0o600, 0o600]
    assert stat.S_IMODE((tmp_path / "agent.crt").stat().st_mode) == 0o644


def test_only_dead_writers_temp_files_are_removed(tmp_path: Path) -> None:
    import fcntl

    target = tmp_path / "state.json"
    write_atomic(target, b"0")
    dead = tmp_path / ".state.json.dead0001.tmp"
    live = tmp_path / ".state.json.live0001.tmp"
    other = tmp_path / ".state.json.b.abcdefgh.tmp"  # the temp of "state.json.b"
    for path in (dead, live, other):
        path.write_bytes(b"partial")
    holder = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # as a live writer holds its own
        write_atomic(target, b"1")
        assert temp_files(tmp_path) == [other.name, live.name]
    finally:
        os.close(holder)
    write_atomic(target, b"2")
    assert temp_files(tmp_path) == [other.name]


def test_missing_parents_are_created_private(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "state.json"
    write_atomic(target, b"x", parents=True)
    assert target.read_bytes() == b"x"
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700


def test_a_temp_file_swept_before_its_lock_is_replaced_by_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one window a sweeper could hit: between mkstemp and the writer's flock."""
    import tempfile

    real = tempfile.mkstemp
    drawn: list[str] = []

    def mkstemp(**kwargs: Any) -> tuple[int, str]:
        fd, name = real(**kwargs)
        drawn.append(name)
        if len(drawn) == 1:
            os.unlink(name)  # as a sweeper that took it for a dead writer's would
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    write_atomic(tmp_path / "state.json", b"whole")
    assert len(drawn) == 2
    assert (tmp_path / "state.json").read_bytes() == b"whole"
    assert temp_files(tmp_path) == []


def test_a_file_system_without_flock_still_gets_whole_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    (tmp_path / ".state.json.dead0001.tmp").write_bytes(b"partial")
    write_atomic(tmp_path / "state.json", b"whole")
    assert (tmp_path / "state.json").read_bytes() == b"whole"
    # Without locks no temp file can be told dead: it stays, nothing else breaks.
    assert temp_files(tmp_path) == [".state.json.dead0001.tmp"]
