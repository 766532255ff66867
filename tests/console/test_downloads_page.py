"""The console's Downloads page: operators only, every action POST then redirect.

The page calls models_registry.downloads, the service /api/downloads calls. The
tests with an agent drive the in-process enrolled agent of the node tests against
the fake hub of the downloads API tests (HF_ENDPOINT points both at it), as
tests/models_registry/test_downloads_api.py does; nothing of ours is mocked.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractUser
from django.test import Client

from console.views import download_row
from models_registry.models import ModelDefinition
from nodes import status_cache
from nodes.models import Node
from tests.factories import make_node
from tests.fakehub import FakeHub
from tests.models_registry.test_downloads_api import (  # noqa: F401  (fixtures, used by name)
    Q4,
    REPO,
    commit,
    connect,
    follow_heartbeats,
    gguf_bytes,
    hub,
)
from tests.nodes.conftest import Enrolled, enrolled  # noqa: F401  (a fixture, used by name)

GIB = 2**30
FEATURES = ["downloads.hf-native", "weights.inventory"]
ROUTES = (
    "/downloads/start/",
    "/downloads/n1/tiny/cancel/",
    "/downloads/n1/tiny/retry/",
    "/downloads/n1/tiny/reclaim/",
)


def _logged_in(user: AbstractUser) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _record(node_id: str, downloads: list[dict[str, Any]], weights: list[dict[str, Any]]) -> None:
    """A status record as the monitor stores it: Online, these downloads and weights."""
    status_cache.write(
        {
            "nodeId": node_id,
            "state": "Online",
            "reasons": [],
            "lastSeen": time.time(),
            "instances": {},
            "downloads": {d["folder"]: d for d in downloads},
            "telemetry": {"weights": weights},
        }
    )


def _download(folder: str, state: str, **fields: Any) -> dict[str, Any]:
    """A download as the agent's heartbeat carries it (agent/weights/_download_state)."""
    return {
        "folder": folder,
        "source": "huggingface",
        "repoId": REPO,
        "revision": "0" * 40,
        "allowPatterns": ["tiny-Q8_0.gguf"],
        "state": state,
        "bytesDone": 0,
        "bytesTotal": None,
        "rateBytesPerSecond": None,
        "error": None,
        **fields,
    }


def _messages(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.mark.django_db
def test_needs_an_operator_login(viewer: AbstractUser, status_redis: object) -> None:
    make_node("n1", facts={"features": FEATURES})
    _record("n1", [_download("tiny", "Failed")], [{"folder": "tiny", "bytes": 5, "fetched": True}])
    for client in (Client(), _logged_in(viewer)):
        page = client.get("/downloads/")
        assert page.status_code == 302 and page["Location"].startswith("/login/")
        for path in ROUTES:
            refused = client.post(path, {"repo": REPO, "variant": "x.gguf", "node": "n1"})
            assert refused.status_code == 302, path
            assert refused["Location"].startswith("/login/"), path


@pytest.mark.django_db
def test_rows_render_as_download_row_with_their_buttons(
    operator: AbstractUser, status_redis: object
) -> None:
    make_node("n1", facts={"features": FEATURES})
    make_node("n2", approved=False)
    ModelDefinition.objects.create(
        served_name="served-tiny", source_folder="kept", source_file="m.gguf", settings={}
    )
    running = _download(
        "b-run", "Running", bytesDone=GIB // 8, bytesTotal=GIB, rateBytesPerSecond=3 * 2**20
    )
    failed = _download("a-failed", "Failed", error="the hub said 500")
    _record(
        "n1",
        [running, failed, _download("c-done", "Completed", bytesDone=10, bytesTotal=10)],
        [
            {"folder": "kept", "bytes": 3 * GIB, "fetched": True},
            {"folder": "mine", "bytes": GIB, "fetched": False},
            {"folder": "spare", "bytes": GIB // 2, "fetched": True},
        ],
    )
    page = _logged_in(operator).get("/downloads/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<span id="live" class="badge">connecting…</span>' in html
    rows = page.context["downloads"]
    assert [r["folder"] for r in rows] == ["a-failed", "b-run", "c-done"]
    assert rows[1]["progress"] == download_row(running)["progress"] == "0.12 / 1.00 GiB (12 %)"
    assert '<td class="progress">0.12 / 1.00 GiB (12 %)</td>' in html
    assert '<td class="rate">3.0 MiB/s</td>' in html
    assert 'tr data-download="n1/b-run"' in html
    assert 'action="/downloads/n1/b-run/cancel/"' in html
    assert 'action="/downloads/n1/a-failed/retry/"' in html
    assert "/downloads/n1/b-run/retry/" not in html and "/downloads/n1/a-failed/cancel/" not in html
    assert "/downloads/n1/c-done/" not in html  # a completed download has no button
    # Only approved nodes can be chosen.
    assert [c[0] for c in page.context["form"].fields["node"].choices] == ["n1"]
    for field in ("repo", "revision", "variant", "node", "folder", "token"):
        assert f'id="download-{field}"' in html
    # Weights: only a fetched folder no model uses can be reclaimed, with a confirmation.
    weights = {w["folder"]: w for w in page.context["weights"]}
    assert {f: w["reclaimable"] for f, w in weights.items()} == {
        "kept": False,
        "mine": False,
        "spare": True,
    }
    assert weights["kept"]["used_by"] == "served-tiny" and weights["spare"]["size"] == "512.0 MiB"
    assert 'action="/downloads/n1/spare/reclaim/"' in html
    assert "/downloads/n1/kept/reclaim/" not in html and "/downloads/n1/mine/reclaim/" not in html
    assert 'data-confirm="Delete the fetched files of spare on n1? (512.0 MiB)"' in html


@pytest.mark.django_db
def test_a_refused_start_is_shown_at_its_field(
    operator: AbstractUser, status_redis: object
) -> None:
    client = _logged_in(operator)
    make_node("n1", facts={"features": FEATURES})  # no status record: Offline
    form = {"repo": REPO, "revision": "", "variant": "tiny-Q8_0.gguf", "node": "n1"}
    missing = client.post("/downloads/start/", {**form, "repo": "", "token": "hf_secret_1"})
    assert missing.status_code == 400
    assert missing.context["form"].errors == {"repo": ["This field is required."]}
    assert b"hf_secret_1" not in missing.content  # the token is never rendered back
    unknown = client.post("/downloads/start/", {**form, "node": "n9"})
    assert unknown.status_code == 400 and "node" in unknown.context["form"].errors
    bad_repo = client.post("/downloads/start/", {**form, "repo": "not a repo"})
    assert bad_repo.status_code == 400
    assert bad_repo.context["form"].errors == {"repo": ["name a Hugging Face repo as owner/name"]}
    bad_folder = client.post("/downloads/start/", {**form, "folder": "../up"})
    assert bad_folder.status_code == 400 and "folder" in bad_folder.context["form"].errors
    offline = client.post("/downloads/start/", {**form, "token": "hf_secret_2"})
    assert offline.status_code == 503
    assert offline.context["form"].non_field_errors() == [
        "Node n1 is not serving (state: Offline); a download cannot be done now."
    ]
    assert b"a download cannot be done now" in offline.content
    assert b"hf_secret_2" not in offline.content
    assert offline.context["form"]["repo"].value() == REPO  # the values are kept


@pytest.mark.django_db
@pytest.mark.usefixtures("master_identity")
def test_refused_actions_redirect_with_the_reason(
    operator: AbstractUser, status_redis: object
) -> None:
    client = _logged_in(operator)
    make_node("n1", facts={"features": FEATURES})
    _record("n1", [_download("going", "Running")], [])
    for path, reason in (
        ("/downloads/n1/gone/retry/", "Node n1 reports no download into 'gone'"),
        ("/downloads/n1/going/retry/", "The download into 'going' is Running; only a Failed"),
        ("/downloads/n1/a%20b/cancel/", "folder:"),
        ("/downloads/n9/tiny/cancel/", "Node 'n9' does not exist."),
        ("/downloads/n1/tiny/reclaim/", "'tiny' on n1 was not reclaimed: "),
    ):
        assert client.get(path).status_code == 405
        response = client.post(path)
        assert response.status_code == 302 and response["Location"] == "/downloads/", path
        [message] = _messages(client.get("/downloads/"))
        assert message.startswith(reason) or reason in message, (path, message)
    # The message is shown once.
    assert _messages(client.get("/downloads/")) == []


# -- against a real agent ---------------------------------------------------------------


class Console:
    """The console as an operator's browser uses it, called from the event loop."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def post(self, path: str, data: dict[str, str] | None = None) -> Any:
        response = await sync_to_async(self.client.post)(path, data or {})
        assert response.status_code == 302, response.content.decode()[:2000]
        assert response["Location"] == "/downloads/"
        return response

    async def page(self) -> Any:
        response = await sync_to_async(self.client.get)("/downloads/")
        assert response.status_code == 200
        return response


async def _state(agent: Enrolled, folder: str, want: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while agent.server.downloads.get(folder)["state"] != want:
        assert time.monotonic() < deadline, agent.server.downloads.get(folder)
        await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_start_retry_and_reclaim_through_the_page(
    enrolled: Enrolled,  # noqa: F811
    operator: AbstractUser,
    hub: FakeHub,  # noqa: F811
    gguf_bytes: bytes,  # noqa: F811
) -> None:
    await connect(enrolled)
    client = Client()
    await sync_to_async(client.force_login)(operator)
    console = Console(client)
    root: Path = enrolled.server.config.models_root_path

    # Start: the service resolves the revision and the variant, the agent fetches.
    await console.post(
        "/downloads/start/",
        {"repo": REPO, "revision": "main", "variant": "tiny-Q4_K_M.gguf", "node": "n1",
         "folder": "split", "token": ""},
    )  # fmt: skip
    record = enrolled.server.downloads.get("split")
    assert record["revision"] == commit(hub) and record["allowPatterns"] == list(Q4)
    [message] = _messages(await console.page())
    assert message.startswith(f"Download of {REPO} (tiny-Q4_K_M.gguf) into 'split' on n1 is ")
    await _state(enrolled, "split", "Completed")
    # Reloading the page after the redirect starts nothing more.
    await console.page()
    assert [d["folder"] for d in enrolled.server.downloads.list()] == ["split"]

    # The folder left out defaults to the repo's name; the agent's refusal is the message.
    await console.post(
        "/downloads/start/", {"repo": REPO, "variant": "tiny-Q8_0.gguf", "node": "n1"}
    )
    await _state(enrolled, "tiny-GGUF", "Completed")
    assert (root / "tiny-GGUF" / "tiny-Q8_0.gguf").read_bytes() == gguf_bytes
    refused = await sync_to_async(client.post)(
        "/downloads/start/",
        {"repo": REPO, "variant": "tiny-Q8_0.gguf", "node": "n1", "folder": "split"},
    )
    assert refused.status_code == 409
    assert "model folder 'split' already exists" in " ".join(
        refused.context["form"].non_field_errors()
    )

    # Retry: a Failed download as the heartbeat reported it starts again from its source.
    status: Any = dict(status_cache.read("n1") or {})
    failed = {
        "folder": "again", "source": "huggingface", "repoId": REPO, "revision": commit(hub),
        "allowPatterns": ["tiny-Q8_0.gguf"], "state": "Failed", "bytesDone": 0,
        "bytesTotal": None, "rateBytesPerSecond": None, "error": "connection reset",
    }  # fmt: skip
    status["downloads"] = {"again": failed}
    await sync_to_async(status_cache.write)(status)
    page = await console.page()
    assert 'action="/downloads/n1/again/retry/"' in page.content.decode()
    await console.post("/downloads/n1/again/retry/")
    assert _messages(await console.page()) == ["The download into 'again' on n1 was started again."]
    await _state(enrolled, "again", "Completed")
    assert enrolled.server.downloads.get("again")["revision"] == commit(hub)
    assert (root / "again" / "tiny-Q8_0.gguf").read_bytes() == gguf_bytes

    # Reclaim: the heartbeat's inventory lists the folders; one is used by a model.
    await sync_to_async(ModelDefinition.objects.create)(
        served_name="tiny", source_folder="tiny-GGUF", source_file="tiny-Q8_0.gguf", settings={}
    )
    await follow_heartbeats(
        enrolled,
        lambda s: (
            {w["folder"] for w in s.get("telemetry", {}).get("weights", [])}
            == {"again", "split", "tiny-GGUF"}
        ),
    )
    weights = {w["folder"]: w for w in (await console.page()).context["weights"]}
    assert {f: w["reclaimable"] for f, w in weights.items()} == {
        "again": True,
        "split": True,
        "tiny-GGUF": False,
    }
    await console.post("/downloads/n1/split/reclaim/")
    assert _messages(await console.page()) == ["'split' on n1 was reclaimed: 720 bytes freed."]
    assert not (root / "split").exists()
    await console.post("/downloads/n1/tiny-GGUF/reclaim/")
    [refusal] = _messages(await console.page())
    assert refusal.startswith("'tiny-GGUF' on n1 was not reclaimed: a model definition uses it")
    assert (root / "tiny-GGUF" / "tiny-Q8_0.gguf").is_file()
    assert await sync_to_async(Node.objects.filter(node_id="n1").exists)()


@pytest.mark.timeout(60)
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_cancel_through_the_page(
    enrolled: Enrolled,  # noqa: F811
    operator: AbstractUser,
    hub: FakeHub,  # noqa: F811
) -> None:
    await connect(enrolled)
    client = Client()
    await sync_to_async(client.force_login)(operator)
    console = Console(client)
    root: Path = enrolled.server.config.models_root_path
    hub.add_repo("org/slow-GGUF", {"slow-Q8_0.gguf": b"s" * (3 << 20)})
    hub.file("org/slow-GGUF", "slow-Q8_0.gguf").stall_after = 4096
    try:
        await console.post(
            "/downloads/start/",
            {"repo": "org/slow-GGUF", "variant": "slow-Q8_0.gguf", "node": "n1", "folder": "slow"},
        )
        await _state(enrolled, "slow", "Running")
        [started] = _messages(await console.page())
        assert started.endswith("into 'slow' on n1 is Queued.")
        await console.post("/downloads/n1/slow/cancel/")
        assert _messages(await console.page()) == ["The download into 'slow' on n1 was cancelled."]
        assert enrolled.server.downloads.list() == []
        assert not (root / "slow.partial").exists() and not (root / "slow").exists()
    finally:
        hub.release()
