"""The traversal corpus (tests/path_corpus.py) against every agent endpoint that takes a
folder or file name, over the mTLS listener, on a models root full of links out.

An escape is a 2xx answer to a hostile name, an answer that lists a directory outside
the root (the sentinel file's name in it), or any file outside the root created,
changed or deleted; the count must be 0, and every refusal a 4xx with a message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yarl
from agent_support import RunningAgent, launch_body
from test_end_to_end import start_agent

from agent._config import AgentConfig, ExecutableEntry
from protocol.tinygguf import write_tiny_gguf
from tests.fakehub import FakeHub
from tests.path_corpus import (
    FETCHED,
    FILES_OUT,
    HOSTILE_NAMES,
    LINKED_IN,
    LINKED_OUT,
    SENTINEL,
    HostileRoot,
    Snapshot,
    build_hostile_root,
    segment,
)

pytestmark = pytest.mark.timeout(120)

REVISION = "0" * 40


@dataclass(frozen=True)
class Outcome:
    what: str
    status: int
    text: str

    @property
    def message(self) -> str:
        try:
            return str(json.loads(self.text)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return ""


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


@pytest.fixture
def hostile(tmp_path: Path, gguf_bytes: bytes) -> HostileRoot:
    return build_hostile_root(tmp_path / "hostile" / "models", gguf_bytes)


@pytest.fixture
def models_root(hostile: HostileRoot) -> Path:
    """The conftest's models root, replaced by the hostile one."""
    return hostile.root


@pytest.fixture
async def agent(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
    hub: FakeHub,
) -> AsyncIterator[RunningAgent]:
    # A real executable, so a launch is refused for its model and not for want of one.
    running = await start_agent(pki, state_dir, tmp_path, make_config(executables=(fake_engine,)))
    try:
        yield running
    finally:
        await running.session.close()
        await running.server.stop()


async def call(agent: RunningAgent, method: str, path: str, payload: Any = None) -> Outcome:
    # encoded=True: the path goes out exactly as built, never normalised by the client.
    url = yarl.URL(agent.base + path, encoded=True)
    async with agent.session.request(method, url, json=payload) as resp:
        return Outcome(f"{method} {path[:120]}", resp.status, await resp.text())


def download_body(folder: str) -> dict[str, Any]:
    return {"folder": folder, "source": "huggingface", "repoId": "org/x", "revision": REVISION}


def launch(folder: str, file: str) -> dict[str, Any]:
    return launch_body("p-1", model={"folder": folder, "file": file})


def name_requests(name: str) -> list[tuple[str, str, Any]]:
    """Every request of the agent's API that puts ``name`` where a folder or file goes."""
    seg, query = segment(name), quote(name, safe="")
    return [
        ("GET", f"/agent/v1/folders/{seg}/gguf", None),
        ("GET", f"/agent/v1/folders/good/gguf?file={query}", None),
        ("GET", f"/agent/v1/folders/{seg}/gguf?file=good.gguf", None),
        ("POST", "/agent/v1/downloads", download_body(name)),
        ("GET", f"/agent/v1/downloads/{seg}", None),
        ("DELETE", f"/agent/v1/downloads/{seg}", None),
        ("DELETE", f"/agent/v1/model-folders/{seg}", None),
        ("POST", "/agent/v1/instances", launch(name, "good.gguf")),
        ("POST", "/agent/v1/instances", launch("good", name)),
        ("GET", f"/agent/v1/logs/{seg}", None),
    ]


def linked_requests() -> list[tuple[str, str, Any]]:
    """The requests whose names pass the name rule but lead out through real links."""
    requests: list[tuple[str, str, Any]] = []
    for folder in LINKED_OUT:
        requests += [
            ("GET", f"/agent/v1/folders/{folder}/gguf", None),
            ("POST", "/agent/v1/downloads", download_body(folder)),
            ("DELETE", f"/agent/v1/model-folders/{folder}", None),
        ]
    for folder, file in FILES_OUT:
        requests += [
            ("GET", f"/agent/v1/folders/{folder}/gguf?file={file}", None),
            ("POST", "/agent/v1/instances", launch(folder, file)),
        ]
    return requests


def judge(outcomes: list[Outcome]) -> tuple[list[Outcome], list[Outcome]]:
    """(escapes, refusals that are not a 4xx with a message)."""
    escapes = [o for o in outcomes if 200 <= o.status < 300 or SENTINEL in o.text]
    unclear = [o for o in outcomes if not 400 <= o.status < 500 or not o.message]
    return escapes, unclear


async def test_the_corpus_escapes_nowhere(agent: RunningAgent, hostile: HostileRoot) -> None:
    before = Snapshot(hostile.outside_paths())
    beside = sorted(hostile.root.parent.iterdir())
    requests = [r for name in HOSTILE_NAMES for r in name_requests(name)] + linked_requests()
    outcomes = [await call(agent, method, path, body) for method, path, body in requests]

    escapes, unclear = judge(outcomes)
    changes = before.changes(Snapshot(hostile.outside_paths()))
    print(
        f"\nagent: {len(outcomes)} hostile requests ({len(HOSTILE_NAMES)} names, "
        f"{len(LINKED_OUT)} linked folders, {len(FILES_OUT)} linked files): "
        f"{len(escapes) + len(changes)} escapes, {len(unclear)} unclear refusals; statuses "
        + ", ".join(
            f"{s}: {sum(o.status == s for o in outcomes)}"
            for s in sorted({o.status for o in outcomes})
        )
    )
    assert escapes == [], escapes[:5]
    assert changes == []
    assert sorted(hostile.root.parent.iterdir()) == beside, "nothing made beside the root"
    assert unclear == [], unclear[:5]
    # Every hostile name is refused by the name rule itself (never a mere "not found",
    # which a name that exists on another platform would not get), but for the logs,
    # which are looked up by name and never touch a path, and the empty name, which
    # leaves no path segment to route.
    count = len(HOSTILE_NAMES) * len(name_requests("x"))
    named, linked = outcomes[:count], outcomes[count:]
    by_rule = [
        o for o in named if "/agent/v1/logs/" not in o.what and "no such endpoint" not in o.message
    ]
    assert len(by_rule) > 500
    rule = ("must match ^[A-Za-z0-9._-]", "must be a non-empty string")  # the latter: ""
    off_rule = [o for o in by_rule if not any(r in o.message for r in rule)]
    assert off_rule == [], off_rule[:5]
    # The names that pass the rule are refused for where their links lead.
    reasons = ("outside the models root", "is a symbolic link", "cannot be resolved")
    off_reason = [o for o in linked if not any(r in o.message for r in reasons)]
    assert off_reason == [], off_reason[:5]


async def test_what_stays_inside_is_still_served(agent: RunningAgent, hostile: HostileRoot) -> None:
    """The controls: the same endpoints answer 2xx for names that stay inside, so the
    refusals above are the confinement's and not an endpoint that refuses everything."""
    for folder in ("good", LINKED_IN):  # LINKED_IN: a link chain that stays inside
        ok = await call(agent, "GET", f"/agent/v1/folders/{folder}/gguf")
        assert ok.status == 200, ok
        assert json.loads(ok.text)["file"] == "good.gguf"
    missing = await call(agent, "POST", "/agent/v1/instances", launch("good", "missing.gguf"))
    assert missing.status == 422 and "does not exist under the models root" in missing.message
    started = await call(agent, "POST", "/agent/v1/instances", launch(LINKED_IN, "good.gguf"))
    assert started.status == 202, started

    inventory = await call(agent, "GET", "/agent/v1/model-folders")
    assert inventory.status == 200
    listed = {f["folder"]: f for f in json.loads(inventory.text)["folders"]}
    assert SENTINEL not in inventory.text and "secret" not in inventory.text
    assert not set(LINKED_OUT) & set(listed), "a folder linked out is not listed"
    assert {"good", LINKED_IN, "mixed", FETCHED} <= set(listed)
    # Links inside a folder are listed by their own names, never with an outside size.
    assert {f["name"]: f["bytes"] for f in listed["mixed"]["files"]} == {
        "mixed.gguf": 0,
        "sub": 0,
    }


async def test_a_manifest_that_leads_out_deletes_only_its_own_file(
    agent: RunningAgent, hostile: HostileRoot
) -> None:
    before = Snapshot(hostile.outside_paths())
    reclaimed = await call(agent, "DELETE", f"/agent/v1/model-folders/{FETCHED}")
    assert reclaimed.status == 200, reclaimed
    assert json.loads(reclaimed.text)["removed"] == ["own.gguf"]
    assert before.changes(Snapshot(hostile.outside_paths())) == []
    assert (hostile.outside / "secret.gguf").is_file()
