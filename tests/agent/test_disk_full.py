"""A full disk, for real: an 8 MiB tmpfs mounted for each test (root only).

On it: a download larger than the free space is refused before a byte is written; a
download whose disk fills up under it fails with the numbers, keeps a true prefix of
its file and resumes once there is room; an atomic state write that does not fit
leaves the old file whole; an engine log that fills the disk is capped without a copy,
and neither the agent's log reader, its own log file nor a relayed container log
stops over it (docs/agent.md, "Logs and disk space").
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_support import Pki, make_identity
from download_support import body, finished, until
from test_end_to_end import launch_ready, start_agent

from agent._config import AgentConfig, ExecutableEntry
from agent._errors import InsufficientDisk
from agent._run import configure_logging
from agent.engines.process._handle import EngineLogWriter, cap_log, open_log
from agent.state._events import EventBus
from agent.telemetry._logs import LogBook, install_agent_log
from agent.weights._downloads import DownloadManager
from protocol.atomic import write_atomic
from tests.fakehub import FakeHub

pytestmark = pytest.mark.timeout(60)

MIB = 1024 * 1024
DISK_SIZE = 8 * MIB


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, unmounted after the test; skipped (saying why) unless root."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root; this runs as uid {os.geteuid()}")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def free(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill(disk: Path, leave: int = 0) -> Path:
    """Write a filler file until the disk is full, then give back ``leave`` bytes."""
    filler = disk / "filler"
    block = b"\0" * (64 * 1024)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        # Byte by byte for the last partial block, so the disk is full to the page.
        while True:
            try:
                if os.write(fd, b"\0") == 0:
                    break
            except OSError:
                break
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)
    assert free(disk) <= leave + 4096, free(disk)
    return filler


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def manager_on(disk: Path, hub: FakeHub, *, reserve: int) -> DownloadManager:
    """A download manager whose models root and state directory are both on ``disk``."""
    (disk / "models").mkdir(exist_ok=True)
    (disk / "state").mkdir(exist_ok=True)
    return DownloadManager(
        models_root=disk / "models",
        state_directory=disk / "state",
        bus=EventBus(),
        endpoint=hub.url,
        reserve_bytes=reserve,
        retry_delay=0.01,
        progress_interval=0.05,
    )


# -- downloads --------------------------------------------------------------------------


async def test_a_download_that_does_not_fit_is_refused_before_a_byte_is_written(
    disk: Path, hub: FakeHub
) -> None:
    big = hub.add_repo("org/big", {"m.gguf": os.urandom(12 * MIB)})
    tight = hub.add_repo("org/tight", {"m.gguf": os.urandom(7 * MIB)})
    manager = manager_on(disk, hub, reserve=2 * MIB)
    await manager.start()
    try:
        with pytest.raises(InsufficientDisk) as refused:
            await manager.create(body("big", big, None))
        error = refused.value
        assert (error.status, error.code) == (409, "insufficient_disk")
        details = error.details or {}
        assert details["neededBytes"] == 12 * MIB and details["reserveBytes"] == 2 * MIB
        assert 7 * MIB < details["freeBytes"] <= DISK_SIZE
        assert f"{12 * MIB} bytes" in error.message and str(details["freeBytes"]) in error.message
        assert "POST it again" in error.message and "DownloadReserveBytes" in error.message
        # Fits the disk, not the disk less the reserve.
        with pytest.raises(InsufficientDisk) as refused:
            await manager.create(body("tight", tight, None))
        assert (refused.value.details or {})["neededBytes"] == 7 * MIB
        assert sorted(p.name for p in (disk / "models").iterdir()) == []
        assert sorted(p.name for p in (disk / "state").iterdir()) == []
    finally:
        await manager.close()


async def test_a_disk_that_fills_mid_download_fails_it_cleanly_and_it_resumes(
    disk: Path, hub: FakeHub
) -> None:
    content = os.urandom(6 * MIB)
    repo = hub.add_repo("org/m", {"m.gguf": content})
    # 5 MiB, then the hub waits: 4 MiB or so are on disk (a flush), the rest in memory.
    hub.file("org/m", "m.gguf").stall_after = 5 * MIB
    manager = manager_on(disk, hub, reserve=0)
    await manager.start()
    part = disk / "models" / "m.partial" / "m.gguf"
    try:
        answer = await manager.create(body("m", repo, None))
        assert answer["state"] == "Queued"
        state_file = disk / "state" / "downloads.json"
        await until(lambda: manager.get("m")["bytesDone"] >= 5 * MIB, what="the stall")
        await until(lambda: part.exists() and part.stat().st_size >= 4 * MIB, what="a flush")
        kept = part.stat().st_size  # the rest (under 1 MiB) waits in memory
        filler = fill(disk, leave=256 * 1024)  # something else fills the disk meanwhile
        hub.release()  # the hub hangs up; the 1 MiB in memory must now be written
        final = await finished(manager, "m")
        assert final["state"] == "Failed", final
        error = final["error"]
        assert error.startswith("the models disk is full"), error
        assert "No space left on device" in error and f"{kept} bytes already written" in error
        assert "POST the download again to resume" in error and "DELETE it" in error
        # The file is a true prefix, exactly the bytes hashed: the part-write was cut.
        assert part.read_bytes() == content[:kept]
        assert final["bytesDone"] == kept
        # downloads.json was replaced whole or not at all (its disk is the full one).
        record = json.loads(state_file.read_text())
        assert [d["folder"] for d in record["downloads"]] == ["m"]
        assert not [p for p in state_file.parent.iterdir() if p.name.endswith(".tmp")]

        filler.unlink()
        again = await manager.create(body("m", repo, None))
        assert again["bytesDone"] == kept  # counted from .partial
        final = await finished(manager, "m")
        assert final["state"] == "Completed", final
        fetched = (disk / "models" / "m" / "m.gguf").read_bytes()
        assert hashlib.sha256(fetched).digest() == hashlib.sha256(content).digest()
        assert hub.gets("m.gguf")[-1].range == f"bytes={kept}-"
    finally:
        hub.release()
        await manager.close()


def test_an_atomic_write_that_does_not_fit_leaves_the_old_file_whole(disk: Path) -> None:
    path = disk / "processes.json"
    old = json.dumps({"instances": [{"id": i} for i in range(100)]}).encode()
    write_atomic(path, old)
    fill(disk)
    with pytest.raises(OSError) as failed:
        write_atomic(path, b"x" * (256 * 1024))
    assert failed.value.errno == errno.ENOSPC
    assert path.read_bytes() == old
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "processes.json"]


# -- logs -------------------------------------------------------------------------------


async def test_an_engine_log_that_fills_the_disk_is_capped_and_the_agent_goes_on(
    pki: Pki,
    disk: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
) -> None:
    state = disk / "state"
    state.mkdir(mode=0o700)
    config = make_config(
        state_directory=state,
        executables=(fake_engine,),
        engine_log_max_bytes=1 * MIB,
        engine_log_files=2,
    )
    make_identity(pki, state)
    install_agent_log()
    agent = await start_agent(pki, state, tmp_path, config)
    log_path = state / "logs" / "ss-m-1.log"
    try:
        await launch_ready(agent, "m-1")
        # The engine's output fills the disk (appended as the engine's O_APPEND fd does).
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
        try:
            with pytest.raises(OSError) as full:
                while True:
                    os.write(fd, b"engine output that never stops ......................\n" * 64)
            assert full.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
        # The poller caps it: no room for a copy, so it is cut without one.
        await until(lambda: log_path.stat().st_size < MIB, what="the cap")
        assert sorted(p.name for p in log_path.parent.iterdir()) == ["ss-m-1.log"]
        assert free(disk) > DISK_SIZE // 2
        async with agent.session.get(agent.url("/agent/v1/proxy/m-1/echo?after-the-cap")) as resp:
            assert resp.status == 200
        assert b"after-the-cap" in log_path.read_bytes()
        await agent.server.logs.poll()
        async with agent.session.get(agent.url("/agent/v1/logs/m-1?limit=50")) as resp:
            lines = [x["text"] for x in (await resp.json())["lines"]]
        assert any("after-the-cap" in t for t in lines), lines
        async with agent.session.get(agent.url("/agent/v1/logs/agent?limit=2000")) as resp:
            agent_lines = [x["text"] for x in (await resp.json())["lines"]]
        assert any("ss-m-1.log" in t and "the disk is full" in t for t in agent_lines)
        async with agent.session.get(agent.url("/agent/v1/instances")) as resp:
            [inst] = (await resp.json())["instances"]
        assert inst["state"] == "Ready"
    finally:
        await agent.session.close()
        await agent.server.stop()


async def test_the_log_reader_on_a_full_disk(disk: Path) -> None:
    path = disk / "ss-m-1.log"
    book = LogBook(
        instances=lambda: [("m-1", "Ready")],
        log_path=lambda _: path,
        cap=lambda p: cap_log(p, MIB, files=2),
    )
    handle, offset = open_log(path, "agent: starting m-1")
    with handle:
        assert offset == 0
    fill(disk)
    # A header that does not fit is left out; the engine would start all the same.
    handle, offset = open_log(disk / "ss-m-2.log", "agent: starting m-2")
    handle.close()
    assert (disk / "ss-m-2.log").read_bytes() == b""
    await book.poll()  # under the cap: read, nothing cut
    answer = await book.read("m-1", {})
    assert answer["lines"][0]["text"].endswith("agent: starting m-1")


def test_a_relayed_container_log_drops_output_while_the_disk_is_full(disk: Path) -> None:
    path = disk / "ss-c-1.log"
    with EngineLogWriter(path) as writer:
        writer.write(b"before\n")
        filler = fill(disk)
        for _ in range(10):
            writer.write(b"x" * 1000 + b"\n")  # never raises: the relay goes on
        # The file's last page had room for some; the rest was dropped, and counted.
        dropped = writer.dropped
        assert dropped > 5000
        filler.unlink()
        writer.write(b"after\n")
        assert writer.dropped == 0
    text = path.read_bytes()
    assert text.startswith(b"before\nxxx") and text.endswith(b"\nafter\n")
    note = f"[agent: {dropped} bytes of output dropped: the disk was full]\n".encode()
    relayed = text[len(b"before\n") : text.index(note)]
    assert len(relayed) + dropped == 10 * 1001, "every byte written or counted as dropped"


@pytest.mark.usefixtures("mirbad_logging")
def test_the_agent_log_file_on_a_full_disk(
    disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_file = disk / "agent.log"
    config = AgentConfig(node_id="n1", state_directory=tmp_path, log_file=log_file)
    logger = logging.getLogger("mirbad.agent.test-full")
    configure_logging("INFO", config)
    try:
        logger.info("before the disk filled")
        filler = fill(disk)
        for i in range(200):
            logger.info("record %d while the disk is full %s", i, "y" * 100)
        errors = capsys.readouterr().err
        assert errors.count("cannot write the log file") == 1, errors
        assert "Traceback" not in errors
        filler.unlink()
        logger.info("after the disk was freed")
        assert "is written again" in capsys.readouterr().err
    finally:
        logging.getLogger("mirbad").handlers[0].close()
    text = log_file.read_text()
    assert "before the disk filled" in text and "after the disk was freed" in text
