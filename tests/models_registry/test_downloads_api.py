"""/api/downloads, /api/model-folders and /api/reclaim against a fake hub and a real agent.

The master reads the fake hub itself (variants, the commit a revision names) and
drives an in-process enrolled agent, which fetches the bytes from the same hub:
``HF_ENDPOINT`` points both at :class:`tests.fakehub.FakeHub`, read at call time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from rest_framework.test import APIClient

from models_registry.models import ModelDefinition
from nodes import status_cache
from nodes.models import Node
from nodes.monitor import NodeWorker
from protocol.tinygguf import write_tiny_gguf
from tests.factories import make_node, set_status
from tests.fakehub import FakeHub
from tests.nodes.conftest import Enrolled

pytestmark = pytest.mark.timeout(60)

REPO = "org/tiny-GGUF"
PRIVATE = "org/private-GGUF"
SECRET = "hf_MasterSideSecret_4b7e19c2"
FEATURES = ["downloads.hf-native", "weights.inventory", "gguf.inspect"]
Q4 = ("tiny-Q4_K_M-00001-of-00002.gguf", "tiny-Q4_K_M-00002-of-00002.gguf")
VALID = {"folder": "tiny", "repoId": REPO, "revision": "main", "variant": "tiny-Q8_0.gguf"}


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=5).read_bytes()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, gguf_bytes: bytes) -> Iterator[FakeHub]:
    """The fake hub, HF_ENDPOINT pointing at it, with a public and a private repo."""
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        fake.add_repo(
            REPO,
            {
                "README.md": b"# tiny\n",
                "tiny-Q8_0.gguf": gguf_bytes,
                Q4[0]: b"part one " * 50,
                Q4[1]: b"part two " * 30,
                "mmproj-tiny-f16.gguf": b"projector" * 10,
                # Only part 1 of 3 is in the repo: listed, but not complete.
                "broken-00001-of-00003.gguf": b"lonely",
            },
        )
        fake.add_repo(PRIVATE, {"secret-Q8_0.gguf": gguf_bytes}, token=SECRET)
        yield fake


def commit(hub: FakeHub, repo_id: str = REPO) -> str:
    return hub._state.repos[repo_id].commit


def error_of(response: Any) -> tuple[int, str, str]:
    body = response.json()
    assert "error" in body, body
    return response.status_code, body["error"]["code"], body["error"]["message"]


# -- inspect: the master reads the hub, no node involved ---------------------------------


@pytest.mark.django_db
def test_inspect_groups_variants_and_resolves_the_commit(
    operator_client: APIClient, hub: FakeHub, gguf_bytes: bytes
) -> None:
    answer = operator_client.get("/api/downloads/inspect", {"repo": REPO})
    assert answer.status_code == 200, answer.json()
    body = answer.json()
    assert body["repoId"] == REPO and body["revision"] == "main"
    assert body["commit"] == commit(hub) and len(body["commit"]) == 40
    variants = {v["name"]: v for v in body["variants"]}
    assert sorted(variants) == ["broken.gguf", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]
    split = variants["tiny-Q4_K_M.gguf"]
    assert split["files"] == split["allowPatterns"] == list(Q4)  # the parts stay together
    assert split["expectedParts"] == 2 and split["complete"] is True
    assert split["modelFile"] == Q4[0]
    assert split["sizeBytes"] == split["needsAtLeastBytes"] == 9 * 50 + 9 * 30
    single = variants["tiny-Q8_0.gguf"]
    assert single["files"] == ["tiny-Q8_0.gguf"] and single["sizeBytes"] == len(gguf_bytes)
    assert single["complete"] is True and single["expectedParts"] == 1
    assert variants["broken.gguf"]["complete"] is False
    assert variants["broken.gguf"]["expectedParts"] == 3
    # The projector is listed apart, never as a variant of its own.
    assert body["projectors"] == [{"name": "mmproj-tiny-f16.gguf", "sizeBytes": 90}]
    assert any(r.path.startswith(f"/api/models/{REPO}") for r in hub.requests)

    pinned = operator_client.get(
        "/api/downloads/inspect", {"repo": REPO, "revision": body["commit"]}
    )
    assert pinned.status_code == 200 and pinned.json()["commit"] == body["commit"]


@pytest.mark.django_db
def test_the_hub_is_hf_endpoint_as_it_is_now(
    operator_client: APIClient, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub reads HF_ENDPOINT once, at import; the master reads it per call."""
    assert operator_client.get("/api/downloads/inspect", {"repo": REPO}).status_code == 200
    with FakeHub() as other:
        other.add_repo("org/elsewhere-GGUF", {"e-Q8_0.gguf": b"e" * 8})
        monkeypatch.setenv("HF_ENDPOINT", other.url + "/")
        moved = operator_client.get("/api/downloads/inspect", {"repo": "org/elsewhere-GGUF"})
        assert moved.status_code == 200, moved.json()
        assert [v["name"] for v in moved.json()["variants"]] == ["e-Q8_0.gguf"]
        assert error_of(operator_client.get("/api/downloads/inspect", {"repo": REPO}))[:2] == (
            404,
            "not_found",
        )
    assert not [r for r in hub.requests if "elsewhere" in r.path]
    # A port that is bound but never listens: the hub cannot be reached.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        monkeypatch.setenv("HF_ENDPOINT", dead)
        answer = operator_client.get("/api/downloads/inspect", {"repo": REPO})
    status, code, message = error_of(answer)
    assert (status, code) == (502, "hub_unavailable"), message
    assert message.startswith(f"The Hugging Face hub at {dead} could not be read for {REPO}")


@pytest.mark.django_db
def test_inspect_maps_hub_errors_and_keeps_the_token_out(
    operator_client: APIClient, hub: FakeHub
) -> None:
    def inspect(token: str | None = None, **query: str) -> Any:
        # The token rides in a header, so it never lands in a URL or an access log.
        headers = {"HTTP_X_HF_TOKEN": token} if token else {}
        return operator_client.get("/api/downloads/inspect", query, **headers)

    status, code, message = error_of(inspect(repo="org/absent"))
    assert (status, code) == (404, "not_found")
    assert "org/absent was not found on the Hugging Face hub at" in message
    assert hub.url in message and "needs a token" in message

    status, code, message = error_of(inspect(repo=REPO, revision="v9"))
    assert (status, code) == (404, "not_found") and "Revision 'v9' of org/tiny-GGUF" in message

    # The hub says 401 for a private repo asked without its token: a clear answer.
    refused = inspect(repo=PRIVATE)
    status, code, message = error_of(refused)
    assert (status, code) == (404, "not_found") and "needs a token" in message
    assert refused.json()["error"]["details"] == {"needsToken": True}
    wrong = inspect(repo=PRIVATE, token="hf_wrong")
    assert "the token given cannot read it" in error_of(wrong)[2]
    assert "hf_wrong" not in wrong.content.decode()
    allowed = inspect(repo=PRIVATE, token=SECRET)
    assert allowed.status_code == 200, allowed.json()
    assert [v["name"] for v in allowed.json()["variants"]] == ["secret-Q8_0.gguf"]
    assert SECRET not in allowed.content.decode()

    for query, field in (({}, "repo:"), ({"repo": "no spaces/ok x"}, "repo:")):
        status, code, message = error_of(inspect(**query))
        assert (status, code) == (400, "invalid_request") and message.startswith(field)


# -- ?node= and the body, decided before any node or hub is asked ------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("master_identity")
def test_node_parameter_rules_on_every_route(
    operator_client: APIClient, status_redis: object, hub: FakeHub
) -> None:
    routes: list[tuple[str, str, Any]] = [
        ("post", "/api/downloads", VALID),
        ("get", "/api/downloads", None),
        ("get", "/api/downloads/tiny", None),
        ("delete", "/api/downloads/tiny", None),
        ("get", "/api/model-folders", None),
        ("post", "/api/reclaim", {"folders": ["tiny"]}),
    ]

    def errors(query: str | None, upto: int = len(routes)) -> list[tuple[int, str, str]]:
        out = []
        for method, path, body in routes[:upto]:
            if path == "/api/reclaim":
                response = operator_client.post(
                    path, {**body, **({"node": query} if query else {})}, format="json"
                )
            else:
                url = path + (f"?node={query}" if query else "")
                response = getattr(operator_client, method)(url, body, format="json")
            out.append(error_of(response))
        return out

    def codes(query: str | None) -> set[tuple[int, str]]:
        return {(status, code) for status, code, _ in errors(query)}

    make_node("a", approved=False)
    assert codes(None) == {(409, "invalid_state")}  # the only member, not approved
    make_node("b", facts={"features": []})
    both = errors(None)
    assert {(s, c) for s, c, _ in both} == {(400, "node_required")}
    assert both[0][2] == "More than one node exists; name the node with ?node=<id>."
    assert codes("Bad_Id") == {(400, "invalid_request")}
    assert {m for _, _, m in errors("Bad_Id")} == {"?node= is not a valid node id."}
    assert codes("zzz") == {(404, "not_found")}
    assert {m for _, _, m in errors("zzz")} == {"Node 'zzz' does not exist."}
    assert codes("a") == {(409, "invalid_state")}
    assert "Node 'a' is not approved yet; approve it first." in {m for *_, m in errors("a")}
    offline = errors("b")
    assert {(s, c) for s, c, _ in offline} == {(503, "node_not_serving")}
    assert offline[0][2] == "Node b is not serving (state: Offline); a download cannot be done now."
    assert offline[4][2].endswith("; reading its model folders cannot be done now.")
    set_status(Node.objects.get(node_id="b"), "Online")
    unsupported = errors("b")
    assert {(s, c) for s, c, _ in unsupported} == {(501, "not_supported")}
    assert "feature 'downloads.hf-native'" in unsupported[0][2]
    assert "feature 'weights.inventory'" in unsupported[4][2]
    # A node with the inventory but not the downloader: only the download routes refuse.
    Node.objects.filter(node_id="b").update(facts={"features": ["weights.inventory"]})
    mixed = [(s, c) for s, c, _ in errors("b", upto=5)]
    assert mixed == [(501, "not_supported")] * 4 + [(503, "node_unreachable")]  # it was asked
    # A reclaim reports the node's answer per folder, here that nothing listens.
    asked = operator_client.post("/api/reclaim", {"node": "b", "folders": ["tiny"]}, format="json")
    assert asked.status_code == 200, asked.json()
    [result] = asked.json()["askedToRemove"]
    assert (result["removed"], result["code"]) == (False, "node_unreachable")
    # Until a node accepted the request, not even the hub was read.
    assert hub.requests == []


@pytest.mark.django_db
def test_the_body_is_checked_field_by_field(
    operator_client: APIClient, status_redis: object, hub: FakeHub
) -> None:
    # The node's address has no listener: an answer that reached it would be 503.
    set_status(make_node("n1", facts={"features": FEATURES}), "Online")

    def post(**changes: Any) -> tuple[int, str, str]:
        body = {**VALID, **changes}
        body = {k: v for k, v in body.items() if v is not ...}
        return error_of(operator_client.post("/api/downloads", body, format="json"))

    status, code, message = post(revison="main")
    assert (status, code) == (400, "invalid_request")
    assert message.startswith("revison: unknown field; known fields are allowPatterns, folder")
    assert post(source="ollama")[:2] == (501, "not_supported")
    assert "Ollama" in post(source="ollama")[2]
    assert post(source="s3")[:2] == (400, "invalid_request")
    for folder in ("../x", "a b", "..", ".", "", 7, "x" * 201):
        status, code, message = post(folder=folder)
        assert (status, code) == (400, "invalid_request") and message.startswith("folder:"), folder
    assert post(folder=...)[2].startswith("folder:")
    assert post(repoId="not a repo")[2].startswith("repoId:")
    assert post(revision=12)[2].startswith("revision:")
    assert post(token=["x"])[2].startswith("token:")
    assert post(allowPatterns=["*.gguf"])[2].startswith("variant, allowPatterns:")
    assert post(variant=["tiny-Q8_0.gguf"])[2].startswith("variant:")
    for patterns in ([], [""], "*.gguf", [3]):
        assert post(variant=..., allowPatterns=patterns)[2].startswith("allowPatterns:")
    assert post(variant=...)[2].startswith("allowPatterns:")
    assert hub.requests == []  # none of these needed the hub

    unknown = operator_client.post("/api/downloads", {**VALID, "variant": "Q2.gguf"}, format="json")
    status, code, message = error_of(unknown)
    assert (status, code) == (400, "invalid_request")
    assert message.startswith(f"variant: 'Q2.gguf' is not a GGUF variant of {REPO} at ")
    assert "choose one of: broken.gguf, tiny-Q4_K_M.gguf, tiny-Q8_0.gguf" in message
    assert unknown.json()["error"]["details"]["variants"] == [
        "broken.gguf",
        "tiny-Q4_K_M.gguf",
        "tiny-Q8_0.gguf",
    ]
    status, code, message = post(repoId="org/absent")
    assert (status, code) == (404, "not_found") and "org/absent" in message
    status, code, message = post(revision="v9")
    assert (status, code) == (404, "not_found") and "Revision 'v9'" in message

    for method in ("get", "delete"):
        for bad in ("..", "a%20b", "x" * 201):
            status, code, message = error_of(
                getattr(operator_client, method)(f"/api/downloads/{bad}")
            )
            assert (status, code) == (400, "invalid_request") and message.startswith("folder:")

    def reclaim(body: Any) -> tuple[int, str, str]:
        return error_of(operator_client.post("/api/reclaim", body, format="json"))

    assert reclaim({"folders": ["../x"]})[2].startswith("folder:")
    assert reclaim({"folders": []})[2].startswith("folders:")
    assert reclaim({"folder": "tiny"})[2].startswith("folder: unknown field")
    assert reclaim({"folders": ["tiny"], "node": 3})[2].startswith("node:")


# -- against a real agent ---------------------------------------------------------------


async def connect(enrolled: Enrolled) -> None:
    """One monitor connect: the node is Online with its features on the record."""
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        if worker.autostart_task is not None:
            await worker.autostart_task
    finally:
        await worker.client.aclose()


async def follow_heartbeats(
    enrolled: Enrolled, check: Callable[[dict[str, Any]], bool], timeout: float = 10
) -> None:
    """Let a monitor worker follow the agent's events until the cached status passes."""
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    await worker.connect()
    task = asyncio.create_task(worker.follow_events())
    try:
        deadline = time.monotonic() + timeout
        while True:
            status = await status_cache.aread(enrolled.node.node_id) or {}
            if check(dict(status)):
                return
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, f"no heartbeat passed the check: {status}"
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if worker.autostart_task is not None:
            await worker.autostart_task
        await worker.client.aclose()


class Master:
    """The operator's /api, called from the event loop; every answer's text is kept."""

    def __init__(self, client: APIClient) -> None:
        self.client = client
        self.texts: list[str] = []

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        do = getattr(self.client, method)
        response = await sync_to_async(do)(path, body, format="json")
        self.texts.append(response.content.decode() + json.dumps(dict(response.headers)))
        return response

    async def finished(self, folder: str, query: str = "", timeout: float = 15) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            answer = await self.call("get", f"/api/downloads/{folder}{query}")
            assert answer.status_code == 200, answer.json()
            body = answer.json()
            if body["state"] in ("Completed", "Failed", "Cancelled"):
                return body
            assert time.monotonic() < deadline, f"download {folder} still {body['state']}"
            await asyncio.sleep(0.05)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_download_inventory_and_reclaim(
    enrolled: Enrolled, operator_client: APIClient, hub: FakeHub, gguf_bytes: bytes
) -> None:
    await connect(enrolled)
    master = Master(operator_client)
    root = enrolled.server.config.models_root_path
    sha = commit(hub)

    # A variant, revision "main", no ?node=: the single node acts, Location stays unscoped.
    started = await master.call(
        "post",
        "/api/downloads",
        {"folder": "split", "repoId": REPO, "revision": "main", "variant": "tiny-Q4_K_M.gguf"},
    )
    assert started.status_code == 202, started.json()
    assert started["Location"] == "/api/downloads/split"
    assert started.json()["node"] == "n1" and started.json()["revision"] == sha
    assert enrolled.server.downloads.get("split")["revision"] == sha  # what the agent got
    assert enrolled.server.downloads.get("split")["allowPatterns"] == list(Q4)
    done = await master.finished("split")
    assert done["state"] == "Completed", done
    assert done["node"] == "n1" and done["bytesDone"] == done["bytesTotal"] == 720
    assert sorted(f["name"] for f in done["files"]) == list(Q4)
    assert all(f["verified"] for f in done["files"])
    # Both parts together, nothing else of the repo, nothing half-written left.
    on_disk = sorted(p.name for p in (root / "split").iterdir())
    assert [n for n in on_disk if not n.startswith(".mirbad")] == list(Q4)
    assert (root / "split" / Q4[1]).read_bytes() == b"part two " * 30
    assert not (root / "split.partial").exists()

    # allowPatterns with ?node=: the revision still arrives as the commit, Location scoped.
    scoped = await master.call(
        "post",
        "/api/downloads?node=n1",
        {"folder": "tiny", "repoId": REPO, "revision": "main", "allowPatterns": ["*Q8_0.gguf"]},
    )
    assert scoped.status_code == 202, scoped.json()
    assert scoped["Location"] == "/api/downloads/tiny?node=n1"
    assert enrolled.server.downloads.get("tiny")["revision"] == sha
    assert (await master.finished("tiny", "?node=n1"))["state"] == "Completed"
    assert (root / "tiny" / "tiny-Q8_0.gguf").read_bytes() == gguf_bytes

    # The agent's own refusals come through with their code and details.
    nothing = await master.call(
        "post", "/api/downloads", {"folder": "none", "repoId": REPO, "allowPatterns": ["*.bin"]}
    )
    assert nothing.status_code == 422, nothing.json()
    assert nothing.json()["error"]["code"] == "nothing_to_download"
    assert "tiny-Q8_0.gguf" in nothing.json()["error"]["details"]["files"]
    again = await master.call("post", "/api/downloads", {**VALID, "folder": "tiny"})
    assert (again.status_code, again.json()["error"]["code"]) == (409, "folder_exists")
    missing = await master.call("get", "/api/downloads/never")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")

    listing = (await master.call("get", "/api/downloads")).json()
    assert listing["node"] == "n1"
    assert {d["folder"]: d["state"] for d in listing["downloads"]} == {
        "split": "Completed",
        "tiny": "Completed",
    }

    # An operator's copy sits beside what the system fetched.
    write_tiny_gguf(root / "copied" / "model.gguf")
    folders = await master.call("get", "/api/model-folders?node=n1")
    assert folders.status_code == 200, folders.json()
    by_name = {f["folder"]: f for f in folders.json()["folders"]}
    assert {name: f["fetched"] for name, f in by_name.items()} == {
        "copied": False,
        "split": True,
        "tiny": True,
    }
    assert by_name["tiny"]["source"] == {"repoId": REPO, "revision": sha}
    assert by_name["copied"]["source"] is None
    one = await master.call("get", "/api/model-folders/copied?node=n1")
    assert one.status_code == 200 and one.json()["fetched"] is False, one.json()
    missing = await master.call("get", "/api/model-folders/nothing-here?node=n1")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Node n1 holds no model folder 'nothing-here'."

    # Reclaim lists only fetched folders no model definition names, from the heartbeat.
    await sync_to_async(ModelDefinition.objects.create)(
        served_name="tiny", source_folder="tiny", source_file="tiny-Q8_0.gguf", settings={}
    )
    await follow_heartbeats(
        enrolled,
        lambda s: (
            {w["folder"] for w in s.get("telemetry", {}).get("weights", [])}
            == {"copied", "split", "tiny"}
        ),
    )
    candidates = (await master.call("get", "/api/reclaim")).json()
    assert candidates == {
        "candidates": [{"node": "n1", "folder": "split", "bytes": 720}],
        "totalBytes": 720,
    }
    assert (root / "split").is_dir()  # listing deletes nothing

    reclaimed = await master.call(
        "post", "/api/reclaim", {"node": "n1", "folders": ["split", "tiny", "copied", "gone"]}
    )
    assert reclaimed.status_code == 200, reclaimed.json()
    body = reclaimed.json()
    assert body["node"] == "n1"
    results = {r["folder"]: r for r in body["askedToRemove"]}
    assert results["split"] == {
        "folder": "split",
        "removed": True,
        "removedFiles": list(Q4),
        "kept": [],
        "bytesFreed": 720,
    }
    assert (results["tiny"]["removed"], results["tiny"]["code"]) == (False, "folder_referenced")
    assert "a model definition uses it" in results["tiny"]["reason"]
    assert (results["copied"]["removed"], results["copied"]["code"]) == (False, "not_fetched")
    assert "was not fetched by MirbadLLM" in results["copied"]["reason"]
    assert (results["gone"]["removed"], results["gone"]["code"]) == (False, "not_found")
    assert not (root / "split").exists()
    assert (root / "tiny" / "tiny-Q8_0.gguf").is_file()
    assert (root / "copied" / "model.gguf").is_file()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_cancel_a_running_download(
    enrolled: Enrolled, operator_client: APIClient, hub: FakeHub
) -> None:
    await connect(enrolled)
    master = Master(operator_client)
    root: Path = enrolled.server.config.models_root_path
    hub.add_repo("org/slow-GGUF", {"slow-Q8_0.gguf": b"s" * (3 << 20)})
    hub.file("org/slow-GGUF", "slow-Q8_0.gguf").stall_after = 4096
    try:
        started = await master.call(
            "post",
            "/api/downloads?node=n1",
            {"folder": "slow", "repoId": "org/slow-GGUF", "variant": "slow-Q8_0.gguf"},
        )
        assert started.status_code == 202, started.json()
        deadline = time.monotonic() + 10
        while not hub.gets("slow-Q8_0.gguf"):
            assert time.monotonic() < deadline, "the agent never asked for the file"
            await asyncio.sleep(0.02)
        running = (await master.call("get", "/api/downloads/slow?node=n1")).json()
        assert running["state"] == "Running", running
        cancelled = await master.call("delete", "/api/downloads/slow?node=n1")
        assert cancelled.status_code == 200, cancelled.json()
        assert cancelled.json()["state"] == "Cancelled" and cancelled.json()["node"] == "n1"
        assert not (root / "slow.partial").exists() and not (root / "slow").exists()
        gone = await master.call("get", "/api/downloads/slow?node=n1")
        assert (gone.status_code, gone.json()["error"]["code"]) == (404, "not_found")
    finally:
        hub.release()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_a_token_protected_repo(
    enrolled: Enrolled, operator_client: APIClient, hub: FakeHub, gguf_bytes: bytes
) -> None:
    await connect(enrolled)
    master = Master(operator_client)
    root = enrolled.server.config.models_root_path
    body = {"folder": "secret", "repoId": PRIVATE, "variant": "secret-Q8_0.gguf"}

    refused = await master.call("post", "/api/downloads", body)
    status, code, message = error_of(refused)
    assert (status, code) == (404, "not_found"), message
    assert f"Repository {PRIVATE} was not found" in message and "needs a token" in message
    assert enrolled.server.downloads.list() == []  # the node was never asked

    started = await master.call("post", "/api/downloads", {**body, "token": SECRET})
    assert started.status_code == 202, started.json()
    assert started.json()["revision"] == commit(hub, PRIVATE)
    assert "token" not in started.json()
    done = await master.finished("secret")
    assert done["state"] == "Completed", done
    assert (root / "secret" / "secret-Q8_0.gguf").read_bytes() == gguf_bytes
    assert all(r.authorization for r in hub.gets("secret-Q8_0.gguf"))  # the agent sent it
    await master.call("get", "/api/downloads")
    await master.call("get", "/api/model-folders")
    await master.call("delete", "/api/downloads/secret")  # forgets the record only
    assert (root / "secret" / "secret-Q8_0.gguf").is_file()
    assert len(master.texts) >= 6
    assert not [text for text in master.texts if SECRET in text]
