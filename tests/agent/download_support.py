"""Fixtures and helpers for the download and weights tests (a fake hub, a manager)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import RunningAgent

from agent.state._events import Event, EventBus, Subscription
from agent.weights._downloads import DownloadManager
from protocol.tinygguf import write_tiny_gguf
from tests.fakehub import FakeHub

SECRET = "hf_TestTokenValue_9f3c1d2e7b"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of a real (tiny) GGUF, written once per session."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=3)
    return path.read_bytes()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fake hub that HF_ENDPOINT points at, for the agents started in the test."""
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


@pytest.fixture
def bus() -> EventBus:
    return EventBus()


@pytest.fixture
def make_manager(
    tmp_path: Path, bus: EventBus, hub: FakeHub
) -> Iterator[Callable[..., DownloadManager]]:
    """Build (not start) download managers on tmp_path's models root and state dir."""
    built: list[DownloadManager] = []

    def build(**overrides: Any) -> DownloadManager:
        root = tmp_path / "models"
        state = tmp_path / "state"
        root.mkdir(exist_ok=True)
        state.mkdir(exist_ok=True)
        options: dict[str, Any] = {
            "models_root": root,
            "state_directory": state,
            "bus": bus,
            "endpoint": hub.url,
            "retry_delay": 0.01,
            "progress_interval": 0.05,
        }
        options.update(overrides)
        manager = DownloadManager(**options)
        built.append(manager)
        return manager

    yield build


@pytest.fixture
async def manager(make_manager: Callable[..., DownloadManager]) -> AsyncIterator[DownloadManager]:
    started = make_manager()
    await started.start()
    try:
        yield started
    finally:
        await started.close()


def body(folder: str, repo: Any, patterns: list[str] | None, token: str | None = None) -> dict:
    """A POST /downloads body for a fake-hub repo."""
    return {
        "folder": folder,
        "source": "huggingface",
        "repoId": repo.repo_id,
        "revision": repo.commit,
        "allowPatterns": patterns,
        "token": token,
    }


async def finished(manager: DownloadManager, folder: str, timeout: float = 15) -> dict[str, Any]:
    """Wait for a download's task and answer its final JSON."""
    download = manager._downloads[folder]
    if download.task is not None:
        await asyncio.wait_for(asyncio.shield(download.task), timeout)
    return manager.get(folder)


async def drain(subscription: Subscription) -> list[Event]:
    """The events a subscription has received so far (waiting a moment for stragglers)."""
    events: list[Event] = []
    while True:
        try:
            event = await asyncio.wait_for(subscription.get(), 0.05)
        except TimeoutError:
            return events
        if event is None:
            return events
        events.append(event)


async def until(check: Callable[[], bool], timeout: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def api(
    agent: RunningAgent, method: str, path: str, payload: Any = None
) -> tuple[int, Any, str]:
    """One call to the agent: (status, JSON body, raw text)."""
    kwargs: dict[str, Any] = {}
    if payload is not None:
        kwargs["data"] = json.dumps(payload).encode()
        kwargs["headers"] = {"Content-Type": "application/json"}
    async with agent.session.request(method, agent.url(path), **kwargs) as resp:
        text = await resp.text()
        return resp.status, (json.loads(text) if text else None), text


async def wait_download(
    agent: RunningAgent,
    folder: str,
    states: tuple[str, ...] = ("Completed", "Failed"),
    timeout: float = 15,
) -> tuple[dict[str, Any], list[str]]:
    """Poll GET /downloads/{folder} until it reaches one of ``states``; also the raw texts."""
    texts: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, answer, text = await api(agent, "GET", f"/agent/v1/downloads/{folder}")
        texts.append(text)
        assert status == 200, answer
        if answer["state"] in states:
            return answer, texts
        await asyncio.sleep(0.05)
    raise AssertionError(f"download {folder} did not reach {states}: {answer}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def all_text_under(directory: Path) -> str:
    """Every file's bytes under ``directory``, decoded leniently, for secret scans."""
    chunks = []
    for base, _dirs, files in os.walk(directory):
        for name in files:
            path = Path(base) / name
            if path.is_file() and not path.is_symlink():
                chunks.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(chunks)
