"""Logs that do not fill a disk: the copy-truncate rule (protocol/logcap.py), the engine
log capped while the engine runs, the console's reader across a cap, the agent's own
log file, and the config keys that set the limits (docs/agent.md, "Logs and disk space").

The full-disk cases are in test_disk_full.py (a small tmpfs).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_support import Pki
from test_end_to_end import launch_ready, start_agent

from agent import ConfigError, load_config
from agent._config import AgentConfig, ExecutableEntry
from agent._run import CappedFileHandler, configure_logging
from agent.engines.process._handle import cap_log, read_log_tail
from agent.telemetry._logs import FileTail, LogRing
from protocol.logcap import Capped, LogLimits, copy_truncate, rotated_name

pytestmark = pytest.mark.timeout(60)

KIB = 1024


def append(path: Path, data: bytes) -> None:
    """One write through an O_APPEND descriptor, as an engine's stdout is."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def numbered(first: int, count: int, width: int = 40) -> bytes:
    """``count`` lines of ``width`` bytes each, newline included, numbered from ``first``."""
    return b"".join(
        f"line {i:06d} ".encode().ljust(width - 1, b".") + b"\n"
        for i in range(first, first + count)
    )


# -- the rule ---------------------------------------------------------------------------


def test_copy_truncate_rotates_a_bounded_number_of_whole_copies(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    limits = LogLimits(max_bytes=4 * KIB, files=3)
    assert copy_truncate(path, limits) is None  # no file yet
    writer = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        written = 0
        copies: list[bytes] = []
        for round_ in range(6):
            data = numbered(round_ * 1000, 120)  # 4,800 bytes: past the limit each round
            os.write(writer, data)
            written += len(data)
            assert copy_truncate(path, LogLimits(max_bytes=len(data), files=3)) is None  # at it
            done = copy_truncate(path, limits)
            assert done is not None and done.reason is None
            assert (done.start, done.end, done.rotated) == (0, len(data), rotated_name(path, 1))
            assert path.stat().st_size == 0
            copies.append(data)
        # The same descriptor goes on at the new end: no hole of NUL bytes.
        os.write(writer, b"after\n")
        assert path.read_bytes() == b"after\n"
    finally:
        os.close(writer)
    # .1 is the newest whole copy; three are kept, the oldest were deleted.
    assert [rotated_name(path, i).read_bytes() for i in (1, 2, 3)] == copies[::-1][:3]
    assert not rotated_name(path, 4).exists()
    assert not path.with_name("x.log.1.part").exists()
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert on_disk <= limits.max_bytes * (limits.files + 1) + 1024, (on_disk, written)


def test_no_rotated_files_and_a_kept_tail(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    append(path, numbered(0, 200))
    done = copy_truncate(path, LogLimits(max_bytes=1 * KIB, files=0))
    assert done is not None and done.rotated is None and done.end == 200 * 40
    assert path.stat().st_size == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["x.log"]
    # keep: only the last bytes, from a line start.
    append(path, numbered(0, 200))
    done = copy_truncate(path, LogLimits(max_bytes=1 * KIB, files=1), keep=1000)
    assert done is not None and done.start % 40 == 0 and done.end == 200 * 40
    kept = rotated_name(path, 1).read_bytes()
    assert kept == numbered(0, 200)[done.start :] and len(kept) <= 1000


def test_cap_log_logs_a_failure_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    path = folder / "ss-m.log"
    append(path, numbered(0, 200))
    # A directory in the way of the copy's rename: not a disk problem, so not truncated.
    (folder / "ss-m.log.1").mkdir()
    (folder / "ss-m.log.1" / "keep").write_text("x")
    with pytest.raises(OSError) as raised:  # the rule itself raises for its caller
        copy_truncate(path, LogLimits(max_bytes=KIB, files=1))
    assert raised.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    with caplog.at_level(logging.WARNING, logger="mirbad.agent.process"):
        for _ in range(5):
            assert cap_log(path, KIB, files=1) is None
    warnings = [r for r in caplog.records if "Could not cap the engine log" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert path.stat().st_size == 200 * 40, "a failed cap leaves the file as it was"
    assert not (folder / "ss-m.log.1.part").exists()


def test_read_log_tail_after_a_cap_reads_the_new_file(tmp_path: Path) -> None:
    path = tmp_path / "ss-m.log"
    append(path, numbered(0, 100))
    offset = path.stat().st_size  # this run's output starts here
    append(path, numbered(100, 100))
    assert read_log_tail(path, offset)[0].startswith("line 000100")
    cap_log(path, KIB)
    append(path, b"error: the model file is broken\n")
    assert read_log_tail(path, offset) == ["error: the model file is broken"]


# -- the console's reader across a cap --------------------------------------------------


def test_lines_written_between_the_read_and_the_cut_are_read_from_the_copy(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ss-m.log"
    ring = LogRing()
    counter = iter(range(1000, 10**6, 50))

    def engine_writes_then_cap(p: Path) -> Capped | None:
        # The engine writes after the tail's read and before the cut (the race a cap
        # must not lose), and half a line that it finishes after the cut.
        first = next(counter)
        append(p, numbered(first, 50) + b"half a li")
        return cap_log(p, 4 * KIB, files=2)

    tail = FileTail(path, ring, cap=engine_writes_then_cap)
    append(path, numbered(0, 150))
    tail.poll()
    append(path, b"ne\n")  # the engine finishes its line in the new file
    append(path, numbered(5000, 150))
    tail.poll()
    texts = [x["text"] for x in ring.tail(2000)]
    expected = (
        [numbered(i, 1).decode().rstrip("\n") for i in range(0, 150)]
        + [numbered(i, 1).decode().rstrip("\n") for i in range(1000, 1050)]
        + ["half a line"]
        + [numbered(i, 1).decode().rstrip("\n") for i in range(5000, 5150)]
        + [numbered(i, 1).decode().rstrip("\n") for i in range(1050, 1100)]
    )
    assert texts == expected
    assert not any(t.startswith("[agent:") for t in texts)


def test_a_cap_without_a_copy_says_how_much_was_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ss-m.log"
    ring = LogRing()

    def cap_without_copies(p: Path) -> Capped | None:
        append(p, numbered(0, 10))  # after the read: no copy keeps it
        return cap_log(p, KIB, files=0)

    tail = FileTail(path, ring, cap=cap_without_copies)
    append(path, numbered(0, 100))
    tail.poll()
    texts = [x["text"] for x in ring.tail(2000)]
    assert len(texts) == 101 and texts[-1].startswith("[agent: 400 bytes of this log were skipped")
    append(path, b"next\n")
    tail.poll()
    assert ring.tail(1)[0]["text"] == "next"


WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
count = int(sys.argv[2])
for i in range(count):
    os.write(fd, b"line %08d ........................................\\n" % i)
    if i % 50 == 49:
        time.sleep(0.001)
"""


def test_a_real_writer_capped_while_it_writes_loses_at_most_a_few_lines(
    tmp_path: Path,
) -> None:
    """A separate process appends as fast as it can while the tail polls and caps.

    Copy-truncate has a window, between the last read of the copy and the cut, where
    a write is lost; this measures it. Lines never repeat or come out of order.
    """
    path = tmp_path / "ss-m.log"
    ring = LogRing(size=100_000)
    caps: list[Capped] = []

    def cap(p: Path) -> Capped | None:
        done = cap_log(p, 64 * KIB, files=2)
        if done is not None:
            caps.append(done)
        return done

    tail = FileTail(path, ring, cap=cap)
    count = 30_000  # 1.8 MB: about 27 caps
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(count)])
    try:
        while writer.poll() is None:
            tail.poll()
            time.sleep(0.002)
    finally:
        writer.wait(10)
    tail.poll()
    numbers = [int(x["text"][5:13]) for x in ring.tail(100_000) if x["text"].startswith("line ")]
    assert numbers == sorted(set(numbers)), "a line repeated or came out of order"
    assert numbers[-1] == count - 1
    lost = count - len(numbers)
    print(f"\ncopy-truncate under a writer: {len(caps)} caps, {lost} of {count} lines lost")
    assert len(caps) >= 15
    # Measured: 0 to 10 lines in 30 caps; a loaded machine widens the window.
    assert lost <= count // 100, f"{lost} lines lost in {len(caps)} caps"


# -- the running agent: EngineLogMaxBytes / EngineLogFiles ------------------------------


async def test_an_engine_log_is_capped_while_the_engine_runs(
    pki: Pki,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
) -> None:
    config = make_config(
        executables=(fake_engine,), engine_log_max_bytes=64 * KIB, engine_log_files=2
    )
    agent = await start_agent(pki, state_dir, tmp_path, config)
    log_path = state_dir / "logs" / "ss-m-1.log"
    try:
        await launch_ready(agent, "m-1")
        pad = "p" * 36_000  # each request's log line is ~36 KB: two pass the cap

        async def request(seq: int) -> None:
            url = agent.url(f"/agent/v1/proxy/m-1/echo?seq={seq:04d}&pad={pad}")
            async with agent.session.get(url) as resp:
                assert resp.status == 200

        seq = 0
        for _round in range(4):
            # The engine writes its line before it answers; no write races the cap here.
            for _ in range(2):
                seq += 1
                await request(seq)
            assert log_path.stat().st_size > 64 * KIB
            deadline = time.monotonic() + 10
            while log_path.stat().st_size > 64 * KIB:
                assert time.monotonic() < deadline, "the engine log was not capped"
                await asyncio.sleep(0.05)
        await request(99)
        # The engine's own descriptor goes on at the start of the truncated file.
        head = log_path.read_bytes()
        assert b"\0" not in head and b"seq=0099" in head and len(head) < 64 * KIB
        kept = sorted(p.name for p in log_path.parent.iterdir() if p.name.startswith("ss-m-1"))
        assert kept == ["ss-m-1.log", "ss-m-1.log.1", "ss-m-1.log.2"]
        assert b"seq=0008" in (log_path.parent / "ss-m-1.log.1").read_bytes()
        assert b"seq=0006" in (log_path.parent / "ss-m-1.log.2").read_bytes()
        # The console read every line across four caps, in order, each once.
        await agent.server.logs.poll()
        async with agent.session.get(agent.url("/agent/v1/logs/m-1?limit=2000")) as resp:
            body = await resp.json()
        seen = [t for x in body["lines"] for t in [x["text"]] if "GET /echo?seq=" in t]
        assert [int(t.split("seq=")[1][:4]) for t in seen] == [*range(1, 9), 99]
    finally:
        await agent.session.close()
        await agent.server.stop()


# -- the agent's own log file: LogFile, LogMaxBytes, LogFiles ----------------------------


def test_the_config_keys_and_their_errors(tmp_path: Path) -> None:
    base = {"NodeId": "n1", "StateDirectory": str(tmp_path / "state")}
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(base))
    config = load_config(path, environ={})
    assert (config.log_file, config.log_max_bytes, config.log_files) == (None, 32 << 20, 3)
    assert (config.engine_log_max_bytes, config.engine_log_files) == (32 << 20, 2)
    assert config.download_reserve_bytes == 1 << 30
    path.write_text(json.dumps({**base, "LogFile": "logs/agent.log", "EngineLogFiles": 0}))
    config = load_config(path, environ={"MIRBAD_AGENT_DOWNLOAD_RESERVE_BYTES": "0"})
    assert config.log_file == tmp_path / "logs" / "agent.log"
    assert config.engine_log_files == 0 and config.download_reserve_bytes == 0
    for key, value, words in (
        ("EngineLogMaxBytes", 1000, "out of range"),
        ("LogFiles", 0, "out of range"),
        ("DownloadReserveBytes", -1, "out of range"),
        ("LogMaxBytes", "big", "not an integer"),
    ):
        path.write_text(json.dumps({**base, key: value}))
        with pytest.raises(ConfigError) as refused:
            load_config(path, environ={})
        assert refused.value.field == key and words in str(refused.value), str(refused.value)


@pytest.mark.usefixtures("mirbad_logging")
def test_the_agent_log_file_rotates_at_its_limit(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "agent.log"
    config = AgentConfig(
        node_id="n1",
        state_directory=tmp_path,
        log_file=log_file,
        log_max_bytes=64 * KIB,
        log_files=2,
    )
    logger = logging.getLogger("mirbad.agent.test-caps")
    configure_logging("INFO", config)
    try:
        [handler] = logging.getLogger("mirbad").handlers
        assert isinstance(handler, CappedFileHandler)
        for i in range(3000):
            logger.info("record %05d %s", i, "x" * 60)
    finally:
        logging.getLogger("mirbad").handlers[0].close()
    names = sorted(p.name for p in log_file.parent.iterdir())
    assert names == ["agent.log", "agent.log.1", "agent.log.2"]
    assert all(p.stat().st_size <= 64 * KIB for p in log_file.parent.iterdir())
    assert "record 02999" in log_file.read_text()
