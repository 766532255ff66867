"""The models root's inventory, and reclaiming only what the system fetched."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_support import launch_body
from download_support import (
    api,
    body,
    finished,
    wait_download,
)
from test_end_to_end import start_agent, wait_ready

from agent._config import AgentConfig, ExecutableEntry
from agent._errors import FolderInUse, InvalidRequest, NotFetched, NotFound
from agent.weights._downloads import MANIFEST_NAME, DownloadManager
from agent.weights._inventory import Weights
from tests.fakehub import FakeHub, HubRepo

pytestmark = pytest.mark.timeout(60)


async def fetch(
    manager: DownloadManager, hub: FakeHub, folder: str, files: dict[str, bytes]
) -> HubRepo:
    """Download a fake-hub repo of ``files`` into ``folder``; answers the repo."""
    repo = hub.add_repo(f"org/{folder}", files)
    await manager.create(body(folder, repo, None))
    assert (await finished(manager, folder))["state"] == "Completed"
    return repo


async def test_inventory_tells_fetched_from_operator_files(
    manager: DownloadManager, hub: FakeHub
) -> None:
    root = manager.models_root
    clean = await fetch(manager, hub, "clean", {"c.gguf": b"c" * 3000, "sub/readme.md": b"r"})
    await fetch(manager, hub, "mixed", {"m.gguf": b"m" * 2000})
    (root / "mixed" / "extra.txt").write_bytes(b"operator")
    (root / "manual").mkdir()
    (root / "manual" / "copied.gguf").write_bytes(b"k" * 500)
    (root / "half.partial").mkdir()
    (root / "loose-file.gguf").write_bytes(b"not a folder")

    inventory = Weights(models_root=root).inventory()
    assert inventory["modelsRoot"] == str(root)
    folders = {f["folder"]: f for f in inventory["folders"]}
    assert set(folders) == {"clean", "mixed", "manual"}
    assert folders["clean"] == {
        "folder": "clean",
        "bytes": 3001,
        "files": [
            {"name": "c.gguf", "bytes": 3000, "fetched": True},
            {"name": "sub/readme.md", "bytes": 1, "fetched": True},
        ],
        "fetched": True,
        "source": {"repoId": "org/clean", "revision": clean.commit},
    }
    assert folders["mixed"]["fetched"] is False, "an operator's file makes it not wholly ours"
    assert {f["name"]: f["fetched"] for f in folders["mixed"]["files"]} == {
        "extra.txt": False,
        "m.gguf": True,
    }
    assert folders["manual"]["fetched"] is False and folders["manual"]["source"] is None
    assert folders["manual"]["files"] == [{"name": "copied.gguf", "bytes": 500, "fetched": False}]

    # A fetched file that changed size is no longer the file that was fetched.
    (root / "clean" / "c.gguf").write_bytes(b"c" * 10)
    again = {f["folder"]: f for f in Weights(models_root=root).scan()}
    assert again["clean"]["fetched"] is False


async def test_reclaim_deletes_only_manifest_files(manager: DownloadManager, hub: FakeHub) -> None:
    root = manager.models_root
    await fetch(manager, hub, "clean", {"c.gguf": b"c" * 3000, "sub/readme.md": b"r"})
    await fetch(manager, hub, "mixed", {"m.gguf": b"m" * 2000})
    (root / "mixed" / "extra.txt").write_bytes(b"operator")
    (root / "mixed" / "notes").mkdir()
    (root / "mixed" / "notes" / "n.txt").write_bytes(b"n")
    weights = Weights(models_root=root)

    result = weights.reclaim("clean")
    assert result == {
        "folder": "clean",
        "removed": ["c.gguf", "sub/readme.md"],
        "kept": [],
        "bytesFreed": 3001,
    }
    assert not (root / "clean").exists()

    result = weights.reclaim("mixed")
    assert result["removed"] == ["m.gguf"] and result["bytesFreed"] == 2000
    assert result["kept"] == ["extra.txt", "notes/n.txt"]
    assert sorted(p.name for p in (root / "mixed").iterdir()) == ["extra.txt", "notes"]
    assert (root / "mixed" / "extra.txt").read_bytes() == b"operator"


async def test_reclaim_refuses_what_it_cannot_prove(
    manager: DownloadManager, hub: FakeHub, tmp_path: Path
) -> None:
    root = manager.models_root
    (root / "manual").mkdir()
    (root / "manual" / "copied.gguf").write_bytes(b"k" * 500)
    weights = Weights(models_root=root, in_use=lambda folder: folder == "busy")

    with pytest.raises(NotFetched) as refused:
        weights.reclaim("manual")
    assert refused.value.status == 409
    assert "was not fetched by MirbadLLM" in refused.value.message
    assert "left alone" in refused.value.message
    assert (root / "manual" / "copied.gguf").exists()

    await fetch(manager, hub, "busy", {"b.gguf": b"b" * 100})
    with pytest.raises(FolderInUse):
        weights.reclaim("busy")
    assert (root / "busy" / "b.gguf").exists()

    with pytest.raises(NotFound):
        weights.reclaim("nothing-here")
    for bad in ("..", ".", "a b"):
        with pytest.raises(InvalidRequest):
            weights.reclaim(bad)

    # A folder that is a symlink (here to a fetched-looking folder outside) is refused.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.gguf").write_bytes(b"o")
    manifest = {"version": 1, "files": [{"name": "o.gguf", "size": 1}]}
    (outside / MANIFEST_NAME).write_text(json.dumps(manifest))
    (root / "linked").symlink_to(outside)
    with pytest.raises(InvalidRequest, match="symbolic link"):
        weights.reclaim("linked")
    assert (outside / "o.gguf").exists()


async def test_a_tampered_manifest_cannot_reach_beyond_its_folder(
    manager: DownloadManager, hub: FakeHub, tmp_path: Path
) -> None:
    root = manager.models_root
    await fetch(manager, hub, "t", {"t.gguf": b"t" * 100, "u.gguf": b"u" * 50})
    victim = root / "victim.gguf"
    victim.write_bytes(b"v" * 7)
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"p" * 50)
    # The operator swapped a fetched file for a symlink of the same size elsewhere, and
    # somebody added entries that climb out of the folder.
    (root / "t" / "u.gguf").unlink()
    (root / "t" / "u.gguf").symlink_to(outside)
    manifest = json.loads((root / "t" / MANIFEST_NAME).read_text())
    manifest["files"] += [
        {"name": "../victim.gguf", "size": 7},
        {"name": str(outside), "size": 50},
    ]
    (root / "t" / MANIFEST_NAME).write_text(json.dumps(manifest))

    result = Weights(models_root=root).reclaim("t")
    assert result["removed"] == ["t.gguf"]
    assert "u.gguf" in result["kept"]
    assert victim.read_bytes() == b"v" * 7
    assert outside.read_bytes() == b"p" * 50
    assert (root / "t" / MANIFEST_NAME).exists(), "kept while a listed path was refused"


async def test_model_folders_over_the_api_and_in_use(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
    hub: FakeHub,
) -> None:
    repo = hub.add_repo("org/served", {"served.gguf": b"s" * 4000})
    agent = await start_agent(pki, state_dir, tmp_path, make_config(executables=(fake_engine,)))
    try:
        status, answer, _ = await api(
            agent, "POST", "/agent/v1/downloads", body("served", repo, None)
        )
        assert status == 202, answer
        await wait_download(agent, "served")
        status, inventory, _ = await api(agent, "GET", "/agent/v1/model-folders")
        assert status == 200
        folders = {f["folder"]: f for f in inventory["folders"]}
        assert folders["served"]["fetched"] is True
        assert folders["served"]["source"] == {"repoId": "org/served", "revision": repo.commit}
        assert folders["demo"]["fetched"] is False

        status, refused, _ = await api(agent, "DELETE", "/agent/v1/model-folders/demo")
        assert (status, refused["error"]["code"]) == (409, "not_fetched")

        launch = launch_body(model={"folder": "served", "file": "served.gguf"})
        status, _instance, _ = await api(agent, "POST", "/agent/v1/instances", launch)
        assert status == 202
        await wait_ready(agent, "m-1")
        status, refused, _ = await api(agent, "DELETE", "/agent/v1/model-folders/served")
        assert (status, refused["error"]["code"]) == (409, "folder_in_use")

        status, _stopped, _ = await api(agent, "POST", "/agent/v1/instances/m-1/stop")
        assert status == 200
        status, result, _ = await api(agent, "DELETE", "/agent/v1/model-folders/served")
        assert status == 200, result
        assert result == {
            "folder": "served",
            "removed": ["served.gguf"],
            "kept": [],
            "bytesFreed": 4000,
        }
        root = agent.server.config.models_root_path
        assert not (root / "served").exists() and (root / "demo" / "demo.gguf").exists()
        status, missing, _ = await api(agent, "DELETE", "/agent/v1/model-folders/served")
        assert (status, missing["error"]["code"]) == (404, "not_found")
        # The heartbeat's cached scan forgot the folder at once.
        assert "served" not in {w["folder"] for w in agent.server.weights.summary()}
    finally:
        await agent.session.close()
        await agent.server.stop()


def test_summary_is_cached_for_the_heartbeat(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "a").mkdir(parents=True)
    weights = Weights(models_root=root, ttl=60)
    assert [w["folder"] for w in weights.summary()] == ["a"]
    (root / "b").mkdir()
    assert [w["folder"] for w in weights.summary()] == ["a"], "within the TTL: cached"
    weights.invalidate()
    assert [w["folder"] for w in weights.summary()] == ["a", "b"]
