"""The download endpoints through the mTLS listener, the token's confinement, a restart."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_support import RunningAgent
from download_support import (
    SECRET,
    all_text_under,
    api,
    body,
    sha256,
    until,
    wait_download,
)
from test_end_to_end import start_agent

from agent._config import AgentConfig
from agent.state._oplog import describe_request, redact_body
from tests.fakehub import FakeHub

pytestmark = pytest.mark.timeout(60)

DOWNLOAD_KEYS = {
    "folder",
    "source",
    "repoId",
    "revision",
    "allowPatterns",
    "state",
    "bytesDone",
    "bytesTotal",
    "rateBytesPerSecond",
    "files",
    "error",
    "needsToken",
    "createdAt",
    "startedAt",
    "finishedAt",
}


@pytest.fixture
def agent_log(tmp_path: Path) -> Iterator[Path]:
    """Every log record of the process at DEBUG (ours, aiohttp's, huggingface_hub's)."""
    path = tmp_path / "agent.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    handler.setLevel(logging.DEBUG)
    loggers = [logging.getLogger(), logging.getLogger("mirbad")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield path
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()


async def read_events(resp: aiohttp.ClientResponse, until_type: str) -> list[dict[str, Any]]:
    """SSE events up to and including the first of ``until_type``."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), 5)).decode().rstrip("\n")
        if line:
            name, _, value = line.partition(": ")
            current[name] = json.loads(value) if name == "data" else value
            continue
        if current:
            events.append(current)
            if current.get("event") == until_type:
                return events
            current = {}


async def test_download_through_the_api(
    running_agent: RunningAgent, hub: FakeHub, tiny_gguf_bytes: bytes
) -> None:
    repo = hub.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_gguf_bytes, "README.md": b"r"})
    status, info, _ = await api(running_agent, "GET", "/agent/v1/info")
    assert {"downloads.hf-native", "weights.inventory"} <= set(info["features"])
    async with running_agent.session.get(running_agent.url("/agent/v1/events")) as stream:
        status, answer, _ = await api(
            running_agent, "POST", "/agent/v1/downloads", body("tiny", repo, ["*.gguf"])
        )
        assert status == 202, answer
        assert set(answer) == DOWNLOAD_KEYS
        assert answer["source"] == "huggingface" and answer["state"] in ("Queued", "Running")
        final, _texts = await wait_download(running_agent, "tiny")
        assert final["state"] == "Completed", final
        events = await read_events(stream, "heartbeat")
    assert [f["verified"] for f in final["files"]] == [True]
    downloads = [e["data"] for e in events if e["event"] == "download"]
    assert downloads and downloads[-1]["state"] == "Completed"
    assert set(downloads[-1]) == DOWNLOAD_KEYS
    beat = events[-1]["data"]
    [compact] = [d for d in beat["downloads"] if d["folder"] == "tiny"]
    assert compact["state"] == "Completed" and "files" not in compact
    weights = {w["folder"]: w for w in beat["weights"]}
    assert weights["tiny"] == {"folder": "tiny", "bytes": len(tiny_gguf_bytes), "fetched": True}
    assert weights["demo"]["fetched"] is False

    status, listing, _ = await api(running_agent, "GET", "/agent/v1/downloads")
    assert status == 200 and [d["folder"] for d in listing["downloads"]] == ["tiny"]
    # A completed download's record can be forgotten; its folder stays.
    status, forgotten, _ = await api(running_agent, "DELETE", "/agent/v1/downloads/tiny")
    assert status == 200 and forgotten["state"] == "Completed"
    assert (running_agent.server.config.models_root_path / "tiny" / "tiny-Q8_0.gguf").exists()
    status, missing, _ = await api(running_agent, "GET", "/agent/v1/downloads/tiny")
    assert status == 404 and missing["error"]["code"] == "not_found"


@pytest.fixture
def tiny_gguf_bytes(tmp_path: Path) -> bytes:
    from protocol.tinygguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf", seed=5).read_bytes()


async def test_api_refusals(running_agent: RunningAgent, hub: FakeHub) -> None:
    repo = hub.add_repo("org/r", {"a.gguf": os.urandom(20_000), "notes.txt": b"n"})
    hub.file("org/r", "a.gguf").stall_after = 1000
    good = body("r", repo, ["*.gguf"])
    path = "/agent/v1/downloads"

    async def refused(payload: Any, status: int, code: str) -> str:
        got, answer, _ = await api(running_agent, "POST", path, payload)
        assert (got, answer["error"]["code"]) == (status, code), answer
        return answer["error"]["message"]

    await refused({**good, "source": "ollama"}, 501, "not_supported")
    assert "40-hex" in await refused({**good, "revision": "main"}, 400, "invalid_request")
    await refused({**good, "folder": ".."}, 400, "invalid_request")
    await refused({**good, "allowPatterns": "*.gguf"}, 400, "invalid_request")
    message = await refused({**good, "allowPatterns": ["*.bin"]}, 422, "nothing_to_download")
    assert "*.bin" in message and "notes.txt" in message
    # The models_root fixture holds an operator folder called demo.
    await refused({**good, "folder": "demo"}, 409, "folder_exists")
    status, _answer, _ = await api(running_agent, "POST", path, good)
    assert status == 202
    await refused(good, 409, "download_running")
    status, missing, _ = await api(running_agent, "GET", f"{path}/nope")
    assert status == 404 and missing["error"]["code"] == "not_found"
    status, missing, _ = await api(running_agent, "DELETE", f"{path}/nope")
    assert status == 404
    status, cancelled, _ = await api(running_agent, "DELETE", f"{path}/r")
    assert status == 200 and cancelled["state"] == "Cancelled"
    assert not (running_agent.server.config.models_root_path / "r.partial").exists()
    hub.release()


async def test_the_token_is_in_no_log_file_or_answer(
    running_agent: RunningAgent, hub: FakeHub, agent_log: Path
) -> None:
    repo = hub.add_repo(
        "org/gated", {"g.gguf": os.urandom(30_000), "README.md": b"x"}, token=SECRET
    )
    hub.file("org/gated", "g.gguf").stall_after = 1000
    texts: list[str] = []
    async with running_agent.session.get(running_agent.url("/agent/v1/events")) as stream:
        # First without the token: the hub's 401 is a Failed download that says why.
        status, answer, text = await api(
            running_agent, "POST", "/agent/v1/downloads", body("gated", repo, None)
        )
        texts.append(text)
        assert status == 202 and answer["state"] == "Failed"
        assert answer["needsToken"] is True and "401" in answer["error"]
        status, answer, text = await api(
            running_agent, "POST", "/agent/v1/downloads", body("gated", repo, None, token=SECRET)
        )
        texts.append(text)
        assert status == 202, answer
        # Mid-flight is when a crash would leave whatever was written: look then too.
        _running, polled = await wait_download(running_agent, "gated", states=("Running",))
        texts += polled
        state_dir = running_agent.server.config.state_directory
        await until(lambda: running_agent.server.downloads.get("gated")["bytesDone"] >= 1000)
        assert SECRET not in all_text_under(state_dir), "the token was persisted mid-flight"
        hub.release()
        final, polled = await wait_download(running_agent, "gated")
        texts += polled
        assert final["state"] == "Completed", final
        events = await read_events(stream, "heartbeat")
        texts += [json.dumps(e) for e in events]
    for method, path in [("GET", "/agent/v1/downloads"), ("GET", "/agent/v1/model-folders")]:
        _status, _answer, text = await api(running_agent, method, path)
        texts.append(text)
    assert [r.authorization for r in hub.requests if "gated" in r.path][-3:] == [True] * 3

    assert (state_dir / "downloads.json").exists() and (state_dir / "operations.json").exists()
    assert "org/gated" in agent_log.read_text(), "the log did record the download"
    for where, text in [
        ("an API answer or event", "\n".join(texts)),
        ("the agent log", agent_log.read_text()),
        ("the state directory (downloads.json, operations.json, ...)", all_text_under(state_dir)),
        ("the models root", all_text_under(running_agent.server.config.models_root_path)),
    ]:
        assert SECRET not in text, f"the token leaked into {where}"


async def test_restart_pauses_a_gated_download_and_a_post_resumes_it(
    hub: FakeHub,
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
) -> None:
    content = os.urandom(150_000)
    repo = hub.add_repo("org/gated", {"g.gguf": content}, token=SECRET)
    hub.file("org/gated", "g.gguf").stall_after = 40_000
    first = await start_agent(pki, state_dir, tmp_path / "first", make_config())
    try:
        status, _answer, _ = await api(
            first, "POST", "/agent/v1/downloads", body("gated", repo, None, token=SECRET)
        )
        assert status == 202
        downloads = first.server.downloads
        await until(lambda: downloads._downloads["gated"].bytes_done >= 40_000, what="bytes")
    finally:
        await first.session.close()
        await first.server.stop()
    hub.release()

    again = await start_agent(pki, state_dir, tmp_path / "again", make_config())
    try:
        status, paused, _ = await api(again, "GET", "/agent/v1/downloads/gated")
        assert status == 200
        assert paused["state"] == "Failed" and paused["needsToken"] is True
        assert paused["error"].startswith("Paused (needs token)")
        assert paused["bytesDone"] == 40_000
        status, _answer, _ = await api(
            again, "POST", "/agent/v1/downloads", body("gated", repo, None, token=SECRET)
        )
        assert status == 202
        final, _ = await wait_download(again, "gated")
        assert final["state"] == "Completed", final
        resumed = hub.gets("g.gguf")[-1]
        assert resumed.range == "bytes=40000-" and resumed.authorization
        root = again.server.config.models_root_path
        assert sha256((root / "gated" / "g.gguf").read_bytes()) == sha256(content)
    finally:
        await again.session.close()
        await again.server.stop()


def test_operation_log_redacts_tokens() -> None:
    recorded = redact_body(json.dumps({"token": SECRET, "nested": {"token": SECRET}}).encode())
    assert SECRET not in recorded and json.loads(recorded)["nested"]["token"] == "[redacted]"
    assert redact_body(b'{"token": null}') == '{"token": null}'
    assert redact_body(b"not json") == "not json"
    # Only /instances/... names an instance; a folder is not mistaken for one.
    assert describe_request("DELETE", "/agent/v1/downloads/tiny") == ("other", None)
    assert describe_request("DELETE", "/agent/v1/model-folders/tiny") == ("other", None)
    assert describe_request("DELETE", "/agent/v1/instances/m-1") == ("delete", "m-1")
