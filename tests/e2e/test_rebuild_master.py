"""Rebuild a master from nothing (issue 15): a real master drives a joined agent that
serves the tiny model on llama-server; a sealed backup is taken; the master is stopped
and its data directory (with its SQLite database) deleted; a new master on a new data
directory is rebuilt from the backup with `manage.py restore --rebuild` and started.
The agent, still running, is driven by the new master without re-enrolling, its
engine is the same process, and /v1 answers through the new master with the old key.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.e2e.conftest import ROOT, join_agent, llama_server_or_fail, wait_for

pytestmark = pytest.mark.slow
PASSPHRASE = "the rebuild passphrase, long enough"


def _instance(api: httpx.Client, node_id: str) -> dict | None:  # type: ignore[type-arg]
    instances = api.get(f"/api/nodes/{node_id}").json().get("instances") or []
    return next((i for i in instances if i.get("state") == "Ready"), None)


def test_a_new_master_rebuilt_from_a_backup_drives_the_running_fleet(
    make_stack, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    llama_server_or_fail()
    old = make_stack(embedded=True)
    facts = old.start()
    old_key = facts["API key"]
    api = old.api(old_key, timeout=60)
    agent = None
    new = None
    try:
        agent, models = join_agent(api, old, tmp_path / "edge", "edge-a", "127.0.0.2")
        write_tiny_gguf(models / "tiny" / "tiny.gguf")
        assert api.post("/api/nodes/edge-a/approve").status_code == 200
        wait_for(lambda: api.get("/api/nodes/edge-a").json()["state"] == "Online", 60, "Online")
        body = {
            "servedName": "tiny", "sourceFolder": "tiny", "sourceFile": "tiny.gguf",
            "settings": {"context_size": 256, "parallel": 1, "gpu_layers": 0},
            "node": "edge-a", "autoStart": True,
        }  # fmt: skip
        created = api.post("/api/models", json=body)
        assert created.status_code == 201, created.text
        model_id = created.json()["id"]
        assert api.post(f"/api/models/{model_id}/start").status_code == 202
        before = wait_for(lambda: _instance(api, "edge-a"), 90, "the engine Ready")
        cert = tmp_path / "edge" / "edge-a" / "state"
        identity = {n: (cert / n).read_bytes() for n in ("agent.key", "agent.crt", "ca.crt")}
        made = api.post("/api/backups", json={"passphrase": PASSPHRASE}).json()
        backup = tmp_path / "backup.json"
        backup.write_bytes(api.get(made["downloadUrl"]).content)
        old_epoch = json.loads(backup.read_text())["master"]["epoch"]
        api.close()

        # -- the master is lost: stopped, its data directory and database gone ---------
        assert old.stop() == 0
        shutil.rmtree(old.data)

        new = make_stack(embedded=True)
        new.env["MIRBAD_BOOTSTRAP_NODE_ID"] = "fresh"  # this new host's own agent
        secret = tmp_path / "passphrase"
        secret.write_text(PASSPHRASE)
        rebuilt = subprocess.run(
            [sys.executable, "manage.py", "restore", str(backup), "--rebuild",
             "--passphrase-file", str(secret)],
            cwd=ROOT, env=new.env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
        answer = json.loads(rebuilt.stdout)
        assert answer["nodes"] == ["edge-a", "local"] and answer["epoch"] > old_epoch
        assert isinstance(answer["reached"]["edge-a"], int)  # the agent answered the takeover
        new_facts = new.start()
        api = new.api(new_facts["API key"], timeout=60)
        wait_for(lambda: api.get("/api/nodes/edge-a").json()["state"] == "Online", 60, "Online")
        after = wait_for(lambda: _instance(api, "edge-a"), 60, "the engine seen Ready")
        assert after["pid"] == before["pid"] and after["instanceId"] == before["instanceId"]
        assert api.get(f"/api/models/{model_id}").json()["state"] == "Ready"
        # The old key was restored (its hash): /v1 through the new master.
        with httpx.Client(base_url=new.url, timeout=60) as client:
            answered = client.post(
                "/v1/chat/completions",
                headers={"Authorization": f"Bearer {old_key}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4},
            )  # fmt: skip
        assert answered.status_code == 200, answered.text
        # No re-enrollment: the agent's identity files are the ones it had.
        assert {n: (cert / n).read_bytes() for n in identity} == identity
        # The engine did not restart: still the process that was Ready before.
        assert _instance(api, "edge-a")["pid"] == before["pid"]  # type: ignore[index]
        with sqlite3.connect(new.data / "db.sqlite3") as db:
            actions = [r[0] for r in db.execute("SELECT action FROM nodes_auditevent")]
        assert "master.rebuilt" in actions
    except BaseException:
        old.print_logs()
        if new is not None:
            new.print_logs()
        raise
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
