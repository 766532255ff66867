"""Hugging Face downloads on the agent, against the fake hub (tests/fakehub.py).

The download manager is driven directly for the mechanics (layout, resume,
verification, disk, restarts); test_downloads_api.py drives the same code through
the mTLS listener.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from download_support import (
    SECRET,
    body,
    drain,
    finished,
    sha256,
    until,
)

from agent._errors import (
    DownloadRunning,
    FolderExists,
    InsufficientDisk,
    InvalidRequest,
    NothingToDownload,
    NotSupported,
)
from agent.engines._spec import check_relative_name, confined_path
from agent.state._events import EventBus
from agent.weights._downloads import MANIFEST_NAME, DownloadManager
from agent.weights._gguf import read_summary
from tests.fakehub import FakeHub

pytestmark = pytest.mark.timeout(60)

GIB = 1024**3


async def test_happy_path_lays_out_verifies_and_reports(
    manager: DownloadManager, hub: FakeHub, bus: EventBus, tiny_gguf: bytes
) -> None:
    readme = b"# tiny\n"
    repo = hub.add_repo(
        "org/tiny-GGUF",
        {"tiny-Q8_0.gguf": tiny_gguf, "README.md": readme, "other-F16.gguf": b"x" * 10},
    )
    root = manager.models_root
    with bus.subscribe() as events:
        answer = await manager.create(body("tiny", repo, ["*Q8_0.gguf", "README.md"]))
        assert answer["state"] == "Queued"
        assert answer["bytesTotal"] == len(tiny_gguf) + len(readme)
        assert answer["rateBytesPerSecond"] is None
        assert answer["createdAt"].endswith("Z") and answer["finishedAt"] is None
        final = await finished(manager, "tiny")
        seen = await drain(events)

    assert final["state"] == "Completed", final
    assert final["error"] is None and final["needsToken"] is False
    assert final["bytesDone"] == final["bytesTotal"] == len(tiny_gguf) + len(readme)
    assert final["startedAt"] and final["finishedAt"]
    assert final["rateBytesPerSecond"] is None  # not Running any more
    files = {f["name"]: f for f in final["files"]}
    assert set(files) == {"tiny-Q8_0.gguf", "README.md"}
    assert files["tiny-Q8_0.gguf"] == {
        "name": "tiny-Q8_0.gguf",
        "size": len(tiny_gguf),
        "sha256": sha256(tiny_gguf),
        "bytesDone": len(tiny_gguf),
        "verified": True,
    }
    assert files["README.md"]["verified"] and files["README.md"]["sha256"] == sha256(readme)

    folder = root / "tiny"
    assert not (root / "tiny.partial").exists()
    assert sorted(p.name for p in folder.iterdir()) == [
        MANIFEST_NAME,
        "README.md",
        "tiny-Q8_0.gguf",
    ]
    assert (folder / "tiny-Q8_0.gguf").read_bytes() == tiny_gguf
    assert read_summary(folder / "tiny-Q8_0.gguf")["architecture"] == "llama"
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["source"]["repoId"] == "org/tiny-GGUF"
    assert manifest["source"]["revision"] == repo.commit
    assert {(f["name"], f["size"], f["sha256"]) for f in manifest["files"]} == {
        ("tiny-Q8_0.gguf", len(tiny_gguf), sha256(tiny_gguf)),
        ("README.md", len(readme), sha256(readme)),
    }
    # Nothing was asked for that the selection left out, and no token was sent.
    assert not hub.gets("other-F16.gguf")
    assert not any(r.authorization for r in hub.requests)

    states = [e.data["state"] for e in seen if e.type == "download"]
    assert states[0] == "Queued" and states[-1] == "Completed" and "Running" in states
    done = [e.data["bytesDone"] for e in seen if e.type == "download"]
    assert done == sorted(done), "progress never goes backwards"
    assert all(e.data["bytesTotal"] == final["bytesTotal"] for e in seen)

    records = json.loads((manager._state_file).read_text())["downloads"]
    assert [r["state"] for r in records] == ["Completed"]


async def test_split_gguf_parts_selected_by_pattern(manager: DownloadManager, hub: FakeHub) -> None:
    parts = {
        "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf": b"a" * 30_000,
        "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf": b"b" * 20_000,
        "big-Q8_0.gguf": b"c" * 40_000,
        "mmproj-F16.gguf": b"d" * 1000,
        "README.md": b"readme",
    }
    repo = hub.add_repo("org/big-GGUF", parts)
    await manager.create(body("big", repo, ["Q4_K_M/*-of-00002.gguf"]))
    final = await finished(manager, "big")
    assert final["state"] == "Completed", final
    assert [f["name"] for f in final["files"]] == [
        "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf",
        "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf",
    ]
    folder = manager.models_root / "big"
    assert sorted(p.name for p in (folder / "Q4_K_M").iterdir()) == [
        "big-Q4_K_M-00001-of-00002.gguf",
        "big-Q4_K_M-00002-of-00002.gguf",
    ]
    assert not (folder / "big-Q8_0.gguf").exists()
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests if "/resolve/" in r.path}
    assert fetched == {"big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"}


async def test_dropped_connection_resumes_with_a_range(
    manager: DownloadManager, hub: FakeHub
) -> None:
    content = os.urandom(300_000)
    repo = hub.add_repo("org/drop", {"model.gguf": content})
    hub.file("org/drop", "model.gguf").drop_after = 120_000
    await manager.create(body("drop", repo, ["*.gguf"]))
    final = await finished(manager, "drop")
    assert final["state"] == "Completed", final
    gets = hub.gets("model.gguf")
    assert [g.range for g in gets] == [None, "bytes=120000-"]
    data = (manager.models_root / "drop" / "model.gguf").read_bytes()
    assert sha256(data) == sha256(content) == final["files"][0]["sha256"]


@pytest.mark.parametrize(
    ("name", "digest_kind"), [("model.gguf", "SHA-256"), ("config.json", "git blob id")]
)
async def test_corrupted_file_fails_verification_naming_it(
    manager: DownloadManager, hub: FakeHub, name: str, digest_kind: str
) -> None:
    content = os.urandom(50_000)
    repo = hub.add_repo("org/bad", {name: content})
    hub.file("org/bad", name).corrupt = True
    await manager.create(body("bad", repo, None))
    final = await finished(manager, "bad")
    assert final["state"] == "Failed"
    error = final["error"]
    assert name in error and f"{digest_kind} mismatch" in error
    hub_file = hub.file("org/bad", name)
    expected = hub_file.sha256 if hub_file.lfs else hub_file.blob_id
    assert f"expected {expected}" in error
    assert "got " in error.split("expected")[1]
    assert not (manager.models_root / "bad").exists(), "a failed download is never finalized"
    assert not (manager.models_root / "bad.partial" / name).exists(), "the bad file is deleted"
    assert final["files"][0]["verified"] is False


async def test_too_small_disk_is_refused_with_the_numbers(
    make_manager: Callable[..., DownloadManager], hub: FakeHub
) -> None:
    repo = hub.add_repo("org/disk", {"m.gguf": b"m" * 200_000})
    small = make_manager(free_bytes=lambda path: 150_000)
    await small.start()
    try:
        with pytest.raises(InsufficientDisk) as refused:
            await small.create(body("disk", repo, None))
        error = refused.value
        assert (error.status, error.code) == (409, "insufficient_disk")
        assert "200000 bytes" in error.message and "150000 bytes" in error.message
        assert "0.00 GiB" in error.message
        assert error.details == {
            "neededBytes": 200_000,
            "freeBytes": 150_000,
            "reserveBytes": 0,
            "otherDownloadsBytes": 0,
        }
        assert "disk" not in small._downloads
        assert not (small.models_root / "disk.partial").exists(), "a refusal leaves no litter"
    finally:
        await small.close()


async def test_disk_check_counts_bytes_already_in_partial(
    make_manager: Callable[..., DownloadManager], hub: FakeHub
) -> None:
    content = os.urandom(200_000)
    repo = hub.add_repo("org/resume", {"m.gguf": content})
    hub.file("org/resume", "m.gguf").drop_after = 150_000
    first = make_manager(retry_delay=0.01)
    await first.start()
    # One attempt only: the drop leaves 150 000 bytes and the download Failed.
    first._hub.attempts = 1
    await first.create(body("resume", repo, None))
    await finished(first, "resume")
    await first.close()
    partial = first.models_root / "resume.partial" / "m.gguf"
    if first.get("resume")["state"] == "Completed":
        pytest.fail("the download should have stopped at the drop")
    assert partial.stat().st_size == 150_000
    # 50 000 bytes are missing; a disk with exactly that much free takes it.
    second = make_manager(free_bytes=lambda path: 50_000)
    await second.start()
    try:
        assert second.get("resume")["bytesDone"] == 150_000
        await second.create(body("resume", repo, None))
        final = await finished(second, "resume")
        assert final["state"] == "Completed", final
        assert hub.gets("m.gguf")[-1].range == "bytes=150000-"
    finally:
        await second.close()


async def test_hub_401_without_token_fails_clearly(manager: DownloadManager, hub: FakeHub) -> None:
    repo = hub.add_repo("org/private", {"p.gguf": b"p" * 1000}, token=SECRET)
    answer = await manager.create(body("private", repo, None))
    assert answer["state"] == "Failed"
    assert answer["needsToken"] is True
    assert "401" in answer["error"] and "token" in answer["error"]
    assert answer["files"] == []
    assert not (manager.models_root / "private").exists()


async def test_token_repo_with_token_sends_it_and_keeps_it_nowhere(
    manager: DownloadManager, hub: FakeHub
) -> None:
    repo = hub.add_repo("org/private", {"p.gguf": b"p" * 5000, "README.md": b"r"}, token=SECRET)
    answer = await manager.create(body("private", repo, None, token=SECRET))
    final = await finished(manager, "private")
    assert final["state"] == "Completed", final
    assert final["needsToken"] is True
    assert all(r.authorization for r in hub.requests)
    assert SECRET not in json.dumps(answer) + json.dumps(final) + json.dumps(manager.list())
    assert SECRET not in manager._state_file.read_text()
    assert SECRET not in repr(manager._downloads["private"])
    assert manager._downloads["private"].token is None, "dropped when the download ended"


async def test_crash_mid_download_then_resume_with_the_token(
    make_manager: Callable[..., DownloadManager], hub: FakeHub
) -> None:
    content = os.urandom(200_000)
    repo = hub.add_repo("org/gated", {"g.gguf": content}, token=SECRET)
    hub.file("org/gated", "g.gguf").stall_after = 64_000
    first = make_manager()
    await first.start()
    await first.create(body("gated", repo, None, token=SECRET))
    download = first._downloads["gated"]
    await until(lambda: download.bytes_done >= 64_000, what="the first 64 000 bytes")
    # A crash: the task dies without recording anything, downloads.json still says
    # Running, and the token existed only in that process.
    assert download.task is not None
    download.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await download.task
    assert json.loads(first._state_file.read_text())["downloads"][0]["state"] == "Running"
    assert first._session is not None
    await first._session.close()
    hub.release()

    second = make_manager()
    await second.start()
    try:
        paused = second.get("gated")
        assert paused["state"] == "Failed"
        assert paused["error"].startswith("Paused (needs token)")
        assert paused["needsToken"] is True
        assert paused["bytesDone"] == 64_000
        assert (second.models_root / "gated.partial" / "g.gguf").stat().st_size == 64_000
        await second.create(body("gated", repo, None, token=SECRET))
        final = await finished(second, "gated")
        assert final["state"] == "Completed", final
        last = hub.gets("g.gguf")[-1]
        assert last.range == "bytes=64000-" and last.authorization
        assert sha256((second.models_root / "gated" / "g.gguf").read_bytes()) == sha256(content)
    finally:
        await second.close()


async def test_restart_without_token_says_interrupted(
    make_manager: Callable[..., DownloadManager], hub: FakeHub
) -> None:
    repo = hub.add_repo("org/open", {"o.gguf": os.urandom(100_000)})
    hub.file("org/open", "o.gguf").stall_after = 10_000
    first = make_manager()
    await first.start()
    await first.create(body("open", repo, None))
    await until(lambda: first._downloads["open"].bytes_done >= 10_000, what="bytes")
    await first.close()  # a clean stop records the interruption at once
    hub.release()
    second = make_manager()
    await second.start()
    try:
        answer = second.get("open")
        assert answer["state"] == "Failed" and answer["needsToken"] is False
        assert answer["error"].startswith("Interrupted by an agent restart")
    finally:
        await second.close()


async def test_at_most_two_run_at_once(manager: DownloadManager, hub: FakeHub) -> None:
    repos = []
    for index in range(3):
        repo = hub.add_repo(f"org/q{index}", {"q.gguf": os.urandom(40_000)})
        hub.file(f"org/q{index}", "q.gguf").stall_after = 1000
        repos.append(repo)
    for index, repo in enumerate(repos):
        await manager.create(body(f"q{index}", repo, None))
    await until(
        lambda: sum(d.state == "Running" for d in manager._downloads.values()) == 2,
        what="two running",
    )
    await asyncio.sleep(0.1)
    assert sorted(d["state"] for d in manager.list()) == ["Queued", "Running", "Running"]
    hub.release()
    for index in range(3):
        assert (await finished(manager, f"q{index}"))["state"] == "Completed"


async def test_refusals_before_anything_starts(manager: DownloadManager, hub: FakeHub) -> None:
    repo = hub.add_repo("org/r", {"a.gguf": b"a" * 100, "b.txt": b"b"})
    hub.file("org/r", "a.gguf").stall_after = 10
    good = body("r", repo, ["*.gguf"])
    with pytest.raises(NotSupported) as refused:
        await manager.create({**good, "source": "ollama"})
    assert refused.value.status == 501
    with pytest.raises(InvalidRequest, match="40-hex commit"):
        await manager.create({**good, "revision": "main"})
    with pytest.raises(NothingToDownload) as nothing:
        await manager.create({**good, "allowPatterns": ["*.safetensors"]})
    assert nothing.value.status == 422
    assert "*.safetensors" in nothing.value.message
    assert "a.gguf" in nothing.value.message and "b.txt" in nothing.value.message
    (manager.models_root / "there").mkdir()
    with pytest.raises(FolderExists):
        await manager.create({**good, "folder": "there"})
    await manager.create(good)
    with pytest.raises(DownloadRunning):
        await manager.create(good)
    hub.release()
    await finished(manager, "r")


@pytest.mark.parametrize("folder", ["..", ".", "a/b", "", "x" * 201, "bad name", None])
async def test_bad_folder_names_are_refused(
    manager: DownloadManager, hub: FakeHub, folder: object
) -> None:
    repo = hub.add_repo("org/n", {"a.gguf": b"a"})
    with pytest.raises(InvalidRequest, match="must match"):
        await manager.create({**body("ok", repo, None), "folder": folder})
    assert not hub.requests, "refused before the hub is asked"


async def test_symlinks_leaving_the_root_are_refused(
    manager: DownloadManager, hub: FakeHub, tmp_path: Path
) -> None:
    repo = hub.add_repo("org/s", {"a.gguf": b"a" * 10})
    root = manager.models_root
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape.partial").symlink_to(outside)
    with pytest.raises(InvalidRequest, match="outside the models root"):
        await manager.create(body("escape", repo, None))
    # The prefix trap: models2 starts with the same characters as models.
    sibling = tmp_path / "models2"
    (sibling / "trap.partial").mkdir(parents=True)
    (root / "trap.partial").symlink_to(sibling / "trap.partial")
    with pytest.raises(InvalidRequest, match="outside the models root"):
        await manager.create(body("trap", repo, None))
    assert str(sibling).startswith(str(root)), "the trap is real: a string prefix matches"
    (root / "linked").symlink_to(outside)
    with pytest.raises(InvalidRequest, match="outside the models root"):
        await manager.create(body("linked", repo, None))
    assert list(outside.iterdir()) == [] and list((sibling / "trap.partial").iterdir()) == []


@pytest.mark.parametrize(
    "name", ["../escape.gguf", "/etc/passwd", "a\\b.gguf", "a/../../b.gguf", "C:x.gguf", "a//b"]
)
async def test_unsafe_file_names_from_the_hub_are_refused(
    manager: DownloadManager, hub: FakeHub, name: str
) -> None:
    repo = hub.add_repo("org/u", {name: b"x", "fine.gguf": b"y"})
    with pytest.raises(InvalidRequest, match="not a plain relative file name"):
        await manager.create(body("u", repo, None))
    assert not (manager.models_root / "u.partial").exists()


async def test_a_hub_file_may_not_take_the_manifest_name(
    manager: DownloadManager, hub: FakeHub
) -> None:
    repo = hub.add_repo("org/m", {MANIFEST_NAME: b"{}", "a.gguf": b"a"})
    with pytest.raises(InvalidRequest, match="bookkeeping"):
        await manager.create(body("m", repo, ["*.gguf"]))


def test_confinement_helpers(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "inside").mkdir(parents=True)
    (tmp_path / "models2" / "x").mkdir(parents=True)
    (root / "trap").symlink_to(tmp_path / "models2" / "x")
    assert confined_path(root, "inside", "new.gguf") == root.resolve() / "inside" / "new.gguf"
    with pytest.raises(InvalidRequest):
        confined_path(root, "trap")
    with pytest.raises(InvalidRequest):
        confined_path(root, "..")
    assert str(check_relative_name("a/b/c.gguf", "t")) == "a/b/c.gguf"
    for bad in ("", ".", "a/./b", "x\x00", "/abs"):
        with pytest.raises(InvalidRequest):
            check_relative_name(bad, "t")


async def test_cancel_removes_partial_and_record(manager: DownloadManager, hub: FakeHub) -> None:
    repo = hub.add_repo("org/c", {"c.gguf": os.urandom(80_000)})
    hub.file("org/c", "c.gguf").stall_after = 5000
    await manager.create(body("c", repo, None))
    await until(lambda: manager._downloads["c"].bytes_done >= 5000, what="bytes")
    answer = await manager.cancel("c")
    assert answer["state"] == "Cancelled"
    assert not (manager.models_root / "c.partial").exists()
    assert "c" not in manager._downloads
    assert json.loads(manager._state_file.read_text())["downloads"] == []


async def test_progress_events_are_throttled(
    make_manager: Callable[..., DownloadManager], bus: EventBus, hub: FakeHub
) -> None:
    repo = hub.add_repo("org/t", {"t.gguf": os.urandom(1000)})
    hub.file("org/t", "t.gguf").stall_after = 10
    slow = make_manager(progress_interval=0.5)
    await slow.start()
    try:
        await slow.create(body("t", repo, None))
        download = slow._downloads["t"]
        await until(lambda: download.state == "Running", what="Running")
        with bus.subscribe() as events:
            for _ in range(200):
                slow._tick(download)
            await asyncio.sleep(0.55)
            for _ in range(200):
                slow._tick(download)
            count = len(await drain(events))
        assert 1 <= count <= 2, count
    finally:
        hub.release()
        await slow.close()


async def test_a_leftover_partial_of_another_source_is_discarded(
    manager: DownloadManager, hub: FakeHub
) -> None:
    old = hub.add_repo("org/old", {"m.gguf": b"o" * 1000})
    new = hub.add_repo("org/new", {"m.gguf": b"n" * 1000})
    hub.file("org/old", "m.gguf").drop_after = 500
    manager._hub.attempts = 1
    await manager.create(body("f", old, None))
    await finished(manager, "f")
    assert (manager.models_root / "f.partial" / "m.gguf").stat().st_size == 500
    await manager.create(body("f", new, None))
    final = await finished(manager, "f")
    assert final["state"] == "Completed"
    assert hub.gets("m.gguf")[-1].range is None, "foreign bytes are not resumed"
    assert (manager.models_root / "f" / "m.gguf").read_bytes() == b"n" * 1000


async def test_an_lfs_redirect_to_a_cdn_is_followed_and_resumed(
    make_manager: Callable[..., DownloadManager],
) -> None:
    content = os.urandom(60_000)
    with FakeHub(redirect_lfs=True) as cdn_hub:
        repo = cdn_hub.add_repo("org/cdn", {"c.gguf": content})
        cdn_hub.file("org/cdn", "c.gguf").drop_after = 20_000
        redirected = make_manager(endpoint=cdn_hub.url)
        await redirected.start()
        try:
            await redirected.create(body("cdn", repo, None))
            final = await finished(redirected, "cdn")
        finally:
            await redirected.close()
        cdn = [(r.path, r.range) for r in cdn_hub.requests if r.path.startswith("/cdn/")]
    assert final["state"] == "Completed", final
    assert cdn == [(f"/cdn/{sha256(content)}", None), (f"/cdn/{sha256(content)}", "bytes=20000-")]


async def test_the_heartbeat_keeps_ten_minutes_of_finished_downloads(
    manager: DownloadManager, hub: FakeHub
) -> None:
    for name in ("old", "new"):
        repo = hub.add_repo(f"org/{name}", {"x.gguf": b"x" * 10})
        await manager.create(body(name, repo, None))
        await finished(manager, name)
    manager._downloads["old"].finished_at = time.time() - 601
    assert [d["folder"] for d in manager.heartbeat()] == ["new"]
    assert "files" not in manager.heartbeat()[0]
