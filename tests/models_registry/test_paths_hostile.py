"""The traversal corpus (tests/path_corpus.py) against every master endpoint and console
view that takes a folder or file name, then the links of a hostile models root through
the master to a real agent.

The first test gives the node an address nothing listens on: a name the master did not
refuse itself would be sent and come back 503, so every answer must be the master's own
4xx. An escape is a 2xx (or a console success) for a hostile name, the sentinel of a
directory outside the root in an answer, or a file outside the root touched.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from asgiref.sync import sync_to_async
from django.contrib.messages import get_messages
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from rest_framework.test import APIClient

from models_registry.models import ModelDefinition
from nodes.monitor import NodeWorker
from protocol.tinygguf import write_tiny_gguf
from tests.factories import make_model, make_node, set_status
from tests.fakehub import FakeHub
from tests.nodes.conftest import Enrolled
from tests.path_corpus import (
    FETCHED,
    FILES_OUT,
    HOSTILE_NAMES,
    LINKED_OUT,
    SENTINEL,
    Snapshot,
    build_hostile_root,
    segment,
)

pytestmark = pytest.mark.timeout(120)

FEATURES = ["downloads.hf-native", "weights.inventory", "gguf.inspect"]
IMAGE = "vllm/vllm-openai@sha256:" + "ab" * 32
REPO = "org/hostile-GGUF"


@dataclass(frozen=True)
class Outcome:
    what: str
    status: int
    message: str


def api_message(response: Any) -> str:
    try:
        return str(json.loads(response.content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def api_requests(name: str, model_id: int) -> list[tuple[str, str, Any]]:
    """Every /api request that puts ``name`` where a folder or file goes."""
    seg, query = segment(name), quote(name, safe="")
    model = {"servedName": "hostile", "sourceFolder": "good", "sourceFile": "good.gguf"}
    requests: list[tuple[str, str, Any]] = [
        ("post", "/api/models", {**model, "sourceFolder": name}),
        ("post", "/api/models", {**model, "sourceFile": name}),
        ("patch", f"/api/models/{model_id}", {"sourceFolder": name}),
        ("patch", f"/api/models/{model_id}", {"sourceFile": name}),
        ("get", f"/api/model-folders/{seg}?node=n1", None),
        ("get", f"/api/model-folders/{seg}/gguf?node=n1", None),
        ("get", f"/api/model-folders/good/gguf?node=n1&file={query}", None),
        ("post", "/api/downloads?node=n1", {"folder": name, "repoId": REPO, "variant": "x.gguf"}),
        ("get", f"/api/downloads/{seg}?node=n1", None),
        ("delete", f"/api/downloads/{seg}?node=n1", None),
        ("post", "/api/reclaim", {"node": "n1", "folders": [name]}),
    ]
    if not name.endswith("."):  # "model." + ".jinja" is the harmless "model..jinja"
        vllm = {**model, "runtime": "vllm", "image": IMAGE, "sourceFile": ""}
        template = {**vllm, "settings": {"chat_template": name + ".jinja"}}
        requests.append(("post", "/api/models", template))
    return requests


def backup_document(folder: str = "good", file: str = "good.gguf") -> bytes:
    model = {"servedName": "alpha", "source": {"folder": folder, "file": file}}
    return json.dumps({"schemaVersion": 2, "models": [model], "nodes": []}).encode()


def console_outcomes(client: Client, name: str) -> list[Outcome]:
    """The console's views: the download form (4xx), its post/redirect/get actions (a
    redirect carrying the refusal as an error message) and the backup upload (4xx)."""
    seg = segment(name)
    outcomes: list[Outcome] = []
    for action in ("cancel", "retry", "reclaim"):
        path = f"/downloads/n1/{seg}/{action}/"
        answer = client.post(path)
        said = [m for m in get_messages(answer.wsgi_request)]
        failed = [str(m) for m in said if m.level_tag == "error"]
        # A redirect with only an error message is a refusal; a 404 never reached a view.
        status = (
            400
            if answer.status_code == 302 and failed and len(failed) == len(said)
            else (answer.status_code)
        )
        message = " ".join(failed) or ("unrouted" if answer.status_code == 404 else "")
        outcomes.append(Outcome(f"POST {path[:80]}", status, message))
    if name and name.strip() == name:  # the form strips what it is given
        form = {"node": "n1", "repo": REPO, "folder": name, "revision": "main", "variant": "x"}
        answer = client.post("/downloads/start/", form)
        text = answer.content.decode()
        # The rule's refusal, the form's length limit or the NUL guard before any view.
        said = ("must match", "at most 200 characters", "holds a NUL character")
        message = " ".join(s for s in said if s in text)
        outcomes.append(Outcome("POST /downloads/start/", answer.status_code, message))
    documents = [backup_document(folder=name)]
    if name:  # an empty file is a vLLM model's whole folder
        documents.append(backup_document(file=name))
    for document in documents:
        upload = SimpleUploadedFile("backup.json", document, content_type="application/json")
        answer = client.post("/backups/restore/", {"document": upload})
        text = answer.content.decode()
        message = "source." if "source.f" in text else ""
        outcomes.append(Outcome("POST /backups/restore/", answer.status_code, message))
    return outcomes


def judge(outcomes: list[Outcome]) -> tuple[list[Outcome], list[Outcome]]:
    """(escapes, refusals that are not a 4xx with a message)."""
    escapes = [o for o in outcomes if o.status < 400 or SENTINEL in o.message]
    unclear = [o for o in outcomes if not 400 <= o.status < 500 or not o.message]
    return escapes, unclear


@pytest.mark.django_db
@pytest.mark.usefixtures("master_identity")
def test_the_master_refuses_the_corpus_itself(
    operator: Any, operator_client: APIClient, status_redis: object
) -> None:
    set_status(make_node("n1", facts={"features": FEATURES}), "Online")  # nothing listens
    model = make_model("m1")
    console = Client()
    console.force_login(operator)

    outcomes: list[Outcome] = []
    for name in HOSTILE_NAMES:
        for method, path, body in api_requests(name, model.pk):
            answer = getattr(operator_client, method)(path, body, format="json")
            message = api_message(answer) or ("unrouted" if answer.status_code == 404 else "")
            outcomes.append(Outcome(f"{method.upper()} {path[:80]}", answer.status_code, message))
        outcomes += console_outcomes(console, name)

    escapes, unclear = judge(outcomes)
    print(
        f"\nmaster: {len(outcomes)} hostile requests ({len(HOSTILE_NAMES)} names): "
        f"{len(escapes)} escapes, {len(unclear)} unclear refusals, "
        f"{sum(o.message == 'unrouted' for o in outcomes)} never routed to a view; statuses "
        + ", ".join(
            f"{s}: {sum(o.status == s for o in outcomes)}"
            for s in sorted({o.status for o in outcomes})
        )
    )
    assert escapes == [], escapes[:5]
    assert unclear == [], unclear[:5]
    assert ModelDefinition.objects.count() == 1
    assert ModelDefinition.objects.get().source_folder == model.source_folder


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, gguf_bytes: bytes) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        fake.add_repo(REPO, {"x.gguf": gguf_bytes})
        yield fake


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_links_out_of_the_root_stay_refused_through_the_master(
    enrolled: Enrolled, operator_client: APIClient, hub: FakeHub, gguf_bytes: bytes
) -> None:
    hostile = build_hostile_root(enrolled.server.config.models_root_path, gguf_bytes)
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()  # Online, with the agent's features on the record
    finally:
        await worker.client.aclose()
    before = Snapshot(hostile.outside_paths())

    async def call(method: str, path: str, body: Any = None) -> Any:
        return await sync_to_async(getattr(operator_client, method))(path, body, format="json")

    outcomes: list[Outcome] = []
    requests: list[tuple[str, str, Any]] = []
    for folder in LINKED_OUT:
        requests += [
            ("get", f"/api/model-folders/{folder}/gguf", None),
            ("get", f"/api/model-folders/{folder}", None),
            ("post", "/api/downloads", {"folder": folder, "repoId": REPO, "variant": "x.gguf"}),
        ]
    requests += [("get", f"/api/model-folders/{d}/gguf?file={f}", None) for d, f in FILES_OUT]
    for method, path, body in requests:
        answer = await call(method, path, body)
        outcomes.append(Outcome(f"{method} {path}", answer.status_code, api_message(answer)))
    escapes, unclear = judge(outcomes)
    assert escapes == [] and unclear == [], (escapes[:3], unclear[:3])

    # Reclaim answers per folder: each linked one refused by the agent, nothing deleted.
    reclaimed = await call("post", "/api/reclaim", {"folders": [*LINKED_OUT, FETCHED]})
    assert reclaimed.status_code == 200, reclaimed.json()
    results = {r["folder"]: r for r in reclaimed.json()["askedToRemove"]}
    assert [f for f in LINKED_OUT if results[f]["removed"]] == []
    assert results[FETCHED]["removed"] is True and results[FETCHED]["removedFiles"] == ["own.gguf"]

    inventory = await call("get", "/api/model-folders")
    assert inventory.status_code == 200
    text = inventory.content.decode()
    assert SENTINEL not in text and "secret" not in text
    assert not set(LINKED_OUT) & {f["folder"] for f in inventory.json()["folders"]}
    assert before.changes(Snapshot(hostile.outside_paths())) == []
    assert (hostile.outside / "secret.gguf").read_bytes() == gguf_bytes
    print(f"\nmaster to agent: {len(outcomes) + len(LINKED_OUT) + 2} linked requests, 0 escapes")


def test_outside_paths_are_what_the_links_reach(tmp_path: Path, gguf_bytes: bytes) -> None:
    """The fixture itself: each linked folder really leads out (a test of the test)."""
    hostile = build_hostile_root(tmp_path / "models", gguf_bytes)
    real_root = hostile.root.resolve()
    for folder in LINKED_OUT:
        link = hostile.root / folder
        try:
            leads = link.resolve(strict=True)
        except (OSError, RuntimeError):
            assert folder == "loop-a"
            continue
        assert not leads.is_relative_to(real_root), folder
    assert str(hostile.sibling).startswith(str(hostile.root)), "the prefix trap is real"
