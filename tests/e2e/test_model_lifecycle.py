"""A model the way an operator runs one, on real processes (issue 4).

Download a tiny GGUF from a fake Hugging Face hub onto the real local agent,
read its header through /api, get the estimate, be refused admission with the
numbers while the node's reserve is too high, start after lowering it, serve
a completion through /v1, come back by itself after the whole stack restarts
(auto-start), survive crashes of llama-server (restarted on the same port),
and go Failed on the third crash within the restart window.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.e2e.conftest import install_llama_server, llama_server_or_fail, wait_for
from tests.fakehub import FakeHub

pytestmark = pytest.mark.slow

REPO = "mirbad/tiny-GGUF"


def instance(api: httpx.Client, model_id: int) -> dict[str, Any] | None:
    node = api.get("/api/nodes/local").json()
    return next((i for i in node["instances"] if i.get("modelId") == model_id), None)


def test_download_admit_serve_restart_and_fail(make_stack, tmp_path: Path) -> None:
    llama_server_or_fail()
    gguf_bytes = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    hub = FakeHub().start()
    try:
        hub.add_repo(REPO, {"tiny-Q8_0.gguf": gguf_bytes, "README.md": b"# tiny\n"})
        stack = make_stack(embedded=False)
        stack.env["HF_ENDPOINT"] = hub.url
        install_llama_server(stack.data / "agent" / "runtimes", stack.env)
        facts = stack.start()
        key = facts["API key"]
        api = stack.api(key, timeout=60)
        try:
            run(stack, api, hub, key)
        except BaseException:
            stack.print_logs()
            raise
    finally:
        hub.stop()


def run(stack: Any, api: httpx.Client, hub: FakeHub, key: str) -> None:
    # -- the repo's variants, then the download onto the node ---------------------------
    inspected = api.get("/api/downloads/inspect", params={"repo": REPO}).json()
    assert [v["name"] for v in inspected["variants"]] == ["tiny-Q8_0.gguf"], inspected
    started = api.post(
        "/api/downloads",
        json={"folder": "tiny", "repoId": REPO, "revision": "main", "variant": "tiny-Q8_0.gguf"},
    )
    assert started.status_code == 202, started.text
    assert started.json()["revision"] == inspected["commit"]  # resolved before it was sent
    done = wait_for(
        lambda: (
            (d := api.get("/api/downloads/tiny").json()).get("state") in ("Completed", "Failed")
            and d
        ),
        60,
        "the download to finish",
    )
    assert done["state"] == "Completed", done
    assert done["bytesDone"] == done["bytesTotal"] == len(hub.file(REPO, "tiny-Q8_0.gguf").content)
    folders = api.get("/api/model-folders").json()["folders"]
    assert [(f["folder"], f["fetched"]) for f in folders if f["folder"] == "tiny"] == [
        ("tiny", True)
    ]

    # -- header and estimate ------------------------------------------------------------
    header = api.get("/api/model-folders/tiny/gguf").json()
    assert header["architecture"] == "llama" and header["file"] == "tiny-Q8_0.gguf", header
    created = api.post(
        "/api/models",
        json={
            "servedName": "tiny",
            "sourceFolder": "tiny",
            "sourceFile": "tiny-Q8_0.gguf",
            "settings": {"context_size": 256, "gpu_layers": 0},
            "autoStart": True,
            "node": "local",
        },
    )
    assert created.status_code == 201, created.text
    model_id = created.json()["id"]
    estimate = api.get(f"/api/models/{model_id}/estimate").json()["placements"][0]
    budget = estimate["budgetBytes"]
    assert budget == estimate["breakdown"]["budget"] > estimate["breakdown"]["weights"] > 0

    # -- admission: refused with the numbers, then admitted -----------------------------
    total = api.get("/api/nodes/local").json()["memoryTotalBytes"]
    assert api.patch("/api/nodes/local", json={"memoryReserveBytes": total}).status_code == 200
    refused = api.post(f"/api/models/{model_id}/start")
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert refused.json()["error"]["code"] == "admission_refused"
    assert f"host memory: needs {budget / 2**30:.1f} GiB" in message, message
    assert f"after the {total / 2**30:.1f} GiB reserve" in message, message
    assert instance(api, model_id) is None  # nothing reached the agent

    assert api.patch("/api/nodes/local", json={"memoryReserveBytes": 0}).status_code == 200
    assert api.post(f"/api/models/{model_id}/start").status_code == 202
    ready = wait_for(
        lambda: (i := instance(api, model_id)) and i["state"] in ("Ready", "Failed") and i,
        120,
        "the model to be Ready",
    )
    assert ready["state"] == "Ready", ready

    # -- a completion through /v1 -------------------------------------------------------
    completion = api.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["message"]["role"] == "assistant"

    # -- measured memory beside the budget ----------------------------------------------
    measured = wait_for(
        lambda: (i := instance(api, model_id)) and i.get("measured"), 30, "a measurement"
    )
    assert measured["kind"] == "rss" and measured["bytes"] > 0
    body = api.get(f"/api/models/{model_id}").json()
    assert body["placements"][0]["measured"]["bytes"] == measured["bytes"]
    accuracy = wait_for(
        lambda: api.get("/api/estimate-accuracy").json()["groups"], 15, "the kept pair"
    )
    assert accuracy[0]["architecture"] == "llama" and accuracy[0]["samples"] >= 1

    # -- the whole stack restarts: the local agent stops its engines, auto-start ---------
    assert stack.stop() == 0
    stack.start()
    again = wait_for(
        lambda: (i := instance(api, model_id)) and i["state"] in ("Ready", "Failed") and i,
        120,
        "auto-start after the restart",
    )
    assert again["state"] == "Ready", again
    assert api.get(f"/api/models/{model_id}").json()["autoStartNote"] is None

    # -- crashes after Ready: restarted on the same port, Failed on the third ------------
    port = again["port"]
    for crash in (1, 2):
        pid = instance(api, model_id)["pid"]  # type: ignore[index]
        os.kill(pid, signal.SIGKILL)
        back = wait_for(
            lambda crash=crash: (
                (i := instance(api, model_id))
                and i["restartCount"] == crash
                and i["state"] in ("Ready", "Failed")
                and i
            ),
            120,
            f"the restart after crash {crash}",
        )
        assert back["state"] == "Ready" and back["port"] == port and back["pid"] != pid, back
    os.kill(instance(api, model_id)["pid"], signal.SIGKILL)  # type: ignore[index]
    failed = wait_for(
        lambda: (i := instance(api, model_id)) and i["state"] == "Failed" and i,
        60,
        "Failed on the third crash",
    )
    assert "RestartBudget" in failed["error"] and "SIGKILL" in failed["error"], failed
    assert api.get(f"/api/models/{model_id}").json()["state"] == "Failed"
