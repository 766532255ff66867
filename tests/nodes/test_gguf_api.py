"""GET /api/model-folders/{folder}/gguf: the ?node= rules, then a real agent's answer."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from rest_framework.test import APIClient

from nodes.monitor import NodeWorker
from protocol.tinygguf import write_tiny_gguf
from tests.factories import make_node, set_status
from tests.nodes.conftest import Enrolled

URL = "/api/model-folders/tiny/gguf"


@pytest.mark.django_db
def test_without_permission(anon_client: APIClient, viewer_client: APIClient) -> None:
    assert anon_client.get(URL).status_code == 401
    assert viewer_client.get(URL).status_code == 403


@pytest.mark.django_db
def test_node_parameter_rules(operator_client: APIClient, status_redis: object) -> None:
    def error(query: str = "") -> tuple[int, str]:
        response = operator_client.get(URL + query)
        return response.status_code, response.json()["error"]["code"]

    pending = make_node("a", approved=False)
    assert error() == (409, "invalid_state")  # the only member, not approved
    make_node("b")
    assert error() == (400, "node_required")
    assert error("?node=Bad_Id") == (400, "invalid_request")
    assert error("?node=zzz") == (404, "not_found")
    assert error("?node=a") == (409, "invalid_state")
    assert error("?node=b") == (503, "node_not_serving")
    node_b = pending.__class__.objects.get(node_id="b")
    set_status(node_b, "Online")
    assert error("?node=b") == (501, "not_supported")  # never reported gguf.inspect


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis")
async def test_reads_the_header_through_the_agent(
    enrolled: Enrolled, operator_client: APIClient
) -> None:
    root = enrolled.server.config.models_root_path
    tiny = write_tiny_gguf(root / "tiny" / "tiny.gguf")
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()  # Online, with its features on the record
    finally:
        await worker.client.aclose()
    get = sync_to_async(operator_client.get)
    ok = await get(URL)
    assert ok.status_code == 200, ok.json()
    body = ok.json()
    assert body["node"] == "n1" and body["architecture"] == "llama" and body["blockCount"] == 2
    (root / "tiny" / "other.gguf").write_bytes(tiny.read_bytes()[:64])
    several = (await get(URL)).json()["error"]
    assert several["details"]["candidates"] == ["other.gguf", "tiny.gguf"]
    broken = await get(URL + "?file=other.gguf")
    assert broken.status_code == 422 and broken.json()["error"]["code"] == "gguf_invalid"
