"""Folder names on the way to an agent: checked by the agent's rule, encoded as one segment."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from rest_framework.test import APIClient

from nodes import agent_client
from nodes.agent_client import AgentClient, AgentRefused
from tests.factories import make_node, set_status

FEATURES = ["downloads.hf-native", "weights.inventory", "gguf.inspect"]
# Folder names the agent refuses, each sent percent-encoded in the URL: a NUL, a query,
# a parent directory, a trailing newline. A "/" cannot be sent in one: Django routes on
# the decoded path, where it starts another segment (404 from the URL map).
BAD = ["a\x00b", "a?file=other.gguf", "..", "tiny\n"]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    """AgentClient's requests, answered 200 {} by a mock transport instead of a node."""
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, json={})

    real = httpx.Client

    def client(**kwargs: Any) -> httpx.Client:
        kwargs.pop("verify", None)
        return real(transport=httpx.MockTransport(handler), **kwargs)

    monkeypatch.setattr(agent_client, "node_ssl_context", lambda node: None)
    monkeypatch.setattr(agent_client.httpx, "Client", client)
    return requests


@pytest.mark.django_db
def test_every_path_value_is_one_encoded_segment(seen: list[httpx.Request]) -> None:
    node = make_node("n1", address="https://agent.example:9443")
    with AgentClient(node=node) as client:
        client.gguf("a?file=x", "real.gguf")
        client.download("a/b")
        client.model_folders()
    paths = [r.url.raw_path for r in seen]
    assert paths[0] == b"/agent/v1/folders/a%3Ffile%3Dx/gguf?file=real.gguf"
    assert paths[1] == b"/agent/v1/downloads/a%2Fb"
    assert paths[2] == b"/agent/v1/model-folders"


def test_dot_segments_are_refused_not_sent() -> None:
    from nodes.agent_client import path_segment

    for value in ("", ".", ".."):
        with pytest.raises(AgentRefused) as caught:
            path_segment(value)
        assert caught.value.status == 400
    assert path_segment("a\x00b#c") == "a%00b%23c"


@pytest.mark.django_db
@pytest.mark.parametrize("folder", BAD)
def test_gguf_refuses_a_bad_folder_before_any_node(
    operator_client: APIClient, status_redis: object, folder: str, seen: list[httpx.Request]
) -> None:
    set_status(make_node("n1", facts={"features": FEATURES}), "Online")
    response = operator_client.get(f"/api/model-folders/{_quoted(folder)}/gguf")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["message"].startswith("folder: ")
    assert error["details"] == {"field": "folder"}
    assert seen == []  # nothing went to the node


@pytest.mark.django_db
@pytest.mark.parametrize("folder", BAD)
@pytest.mark.parametrize("url", ["/api/model-folders/{}", "/api/downloads/{}"])
def test_folder_views_refuse_a_bad_folder(
    operator_client: APIClient,
    status_redis: object,
    folder: str,
    url: str,
    seen: list[httpx.Request],
) -> None:
    set_status(make_node("n1", facts={"features": FEATURES}), "Online")
    response = operator_client.get(url.format(_quoted(folder)))
    assert response.status_code == 400, response.content
    assert response.json()["error"]["details"] == {"field": "folder"}
    assert seen == []


@pytest.mark.django_db
def test_reclaim_refuses_a_folder_with_a_slash(
    operator_client: APIClient, status_redis: object, seen: list[httpx.Request]
) -> None:
    set_status(make_node("n1", facts={"features": FEATURES}), "Online")
    response = operator_client.post("/api/reclaim", {"folders": ["a/b"]}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("folder: ")
    assert seen == []


def _quoted(folder: str) -> str:
    from urllib.parse import quote

    return quote(folder, safe="")
