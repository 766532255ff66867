"""Restore through the console in Chromium (issue 15): a real stack holds a model whose
weights came from a (fake) Hugging Face hub; after a sealed backup the model and its
weights are deleted; the backup is uploaded on the Restore page, previewed (nothing
changes), confirmed, and the page follows, live and without a reload, the Celery
worker downloading the folder through the agent and starting the auto-start model,
which then answers /v1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.e2e.browser_support import launch, log_in, stack_with_hub
from tests.e2e.conftest import wait_for

pytestmark = pytest.mark.slow
REPO = "mirbad/restore-GGUF"
PASSPHRASE = "a restore passphrase, long enough"


def _ready(api: httpx.Client, model_id: int) -> bool:
    return api.get(f"/api/models/{model_id}").json().get("state") == "Ready"


def test_restore_downloads_and_starts_live_in_the_console(
    make_stack: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    stack, hub, facts = stack_with_hub(make_stack, request)
    hub.add_repo(REPO, {"tiny-Q8_0.gguf": write_tiny_gguf(tmp_path / "t.gguf").read_bytes()})
    api = stack.api(facts["API key"], timeout=60)
    try:
        started = api.post("/api/downloads", json={"folder": "restored", "repoId": REPO,
                                                   "variant": "tiny-Q8_0.gguf"})  # fmt: skip
        assert started.status_code == 202, started.text
        wait_for(lambda: api.get("/api/downloads/restored").json().get("state") == "Completed",
                 60, "the first download")  # fmt: skip
        body = {
            "servedName": "restored", "sourceFolder": "restored",
            "sourceFile": "tiny-Q8_0.gguf", "node": "local", "autoStart": True,
            "settings": {"context_size": 256, "parallel": 1, "gpu_layers": 0},
        }  # fmt: skip
        model_id = api.post("/api/models", json=body).json()["id"]
        assert api.post(f"/api/models/{model_id}/start").status_code == 202
        wait_for(lambda: _ready(api, model_id), 90, "Ready")
        made = api.post("/api/backups", json={"passphrase": PASSPHRASE}).json()
        document = api.get(made["downloadUrl"]).content
        source = json.loads(document)["sources"]["restored"]
        assert source["repoId"] == REPO and source["files"][0]["name"] == "tiny-Q8_0.gguf"
        backup = tmp_path / "backup.json"
        backup.write_bytes(document)
        # Lose the model and its weights.
        assert api.post(f"/api/models/{model_id}/stop").status_code in (200, 202)
        wait_for(lambda: api.delete(f"/api/models/{model_id}").status_code == 204, 60, "deleted")
        gone = api.post("/api/reclaim", json={"node": "local", "folders": ["restored"]})
        assert gone.status_code == 200, gone.text
        folders = api.get("/api/model-folders").json()["folders"]
        assert "restored" not in [f["folder"] for f in folders]

        # The restore's download stalls until released: the page must show it moving.
        hub_file = hub.file(REPO, "tiny-Q8_0.gguf")
        hub_file.gets, hub_file.stall_after = 0, 100_000

        with sync_playwright() as pw:
            browser = launch(pw)
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            log_in(page, stack, facts)
            page.goto(f"{stack.url}/backups/restore/")
            page.set_input_files("#id_document", str(backup))
            page.fill("#id_passphrase", PASSPHRASE)
            page.click("#restore-upload button[type=submit]")
            page.wait_for_selector("#restore-models")
            row = page.inner_text("#restore-models tbody")
            assert "restored" in row and "new" in row and "to download" in row, row
            assert "1 already here" in page.inner_text("#restore-keys")  # the local key
            assert api.get("/api/models").json()["models"] == []  # nothing changed yet
            page.screenshot(path=str(tmp_path / "restore-preview.png"))
            page.fill("#id_passphrase", PASSPHRASE)
            page.click("#restore-confirm button[type=submit]")
            page.wait_for_selector("#restore-steps")
            url = page.url
            navigations: list[str] = []
            page.on("framenavigated", lambda frame: navigations.append(frame.url))
            # Live: the page, never reloaded, shows the stalled download, then the start.
            page.wait_for_selector("#restore-steps .s-downloading", timeout=60_000)
            page.screenshot(path=str(tmp_path / "restore-downloading.png"))
            hub.release()
            page.wait_for_selector("#restore-steps .s-started", timeout=120_000)
            page.wait_for_selector("#restore-steps[data-state=done]", timeout=30_000)
            assert page.url == url and navigations == []
            page.screenshot(path=str(tmp_path / "restore-done.png"))
            assert errors == []
            browser.close()
        restored = next(m for m in api.get("/api/models").json()["models"]
                        if m["servedName"] == "restored")  # fmt: skip
        assert restored["state"] == "Ready"
        answered = api.post("/v1/chat/completions", json={
            "model": "restored", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        })  # fmt: skip
        assert answered.status_code == 200, answered.text
        folders = {f["folder"]: f for f in api.get("/api/model-folders").json()["folders"]}
        assert folders["restored"]["fetched"] is True
    except BaseException:
        stack.print_logs()
        raise
