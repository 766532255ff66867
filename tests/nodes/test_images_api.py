"""GET /api/nodes/{id}/images: who may ask, the serving rule, the agent's answer and its
refusals as the API's (a stubbed agent), and a real agent without DockerEnabled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from rest_framework.test import APIClient

from nodes import agent_client
from protocol.fencing import MASTER_HEADER
from tests.factories import make_node, set_status
from tests.nodes.conftest import Enrolled

URL = "/api/nodes/n1/images"
IMAGE = {
    "id": "sha256:" + "ab" * 32,
    "tags": ["localhost/engine:1", "localhost/engine:latest"],
    "digests": ["localhost/engine@sha256:" + "cd" * 32],
    "sizeBytes": 123456,
    "createdAt": "2026-12-01T08:00:00.000Z",
}

Answer = Callable[[httpx.Request], httpx.Response]


class StubAgent:
    """What AgentClient sends, answered by ``answer`` instead of a node."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.answer: Answer = lambda request: httpx.Response(
            200, json={"images": [IMAGE], "truncated": False}
        )

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.answer(request)


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> StubAgent:
    stub = StubAgent()
    real = httpx.Client

    def client(**kwargs: Any) -> httpx.Client:
        kwargs.pop("verify", None)
        return real(transport=httpx.MockTransport(stub.handle), **kwargs)

    monkeypatch.setattr(agent_client, "node_ssl_context", lambda node: None)
    monkeypatch.setattr(agent_client.httpx, "Client", client)
    return stub


def _refusal(status: int, code: str, message: str = "no") -> Answer:
    return lambda request: httpx.Response(
        status, json={"error": {"code": code, "message": message}}
    )


def _raises(exc: type[httpx.HTTPError]) -> Answer:
    def answer(request: httpx.Request) -> httpx.Response:
        raise exc("cut", request=request)

    return answer


@pytest.mark.django_db
def test_the_images_without_permission(
    anon_client: APIClient,
    viewer_client: APIClient,
    chat_key: str,
    admin_key: str,
    status_redis: object,
    agent: StubAgent,
) -> None:
    set_status(make_node("n1"), "Online")
    anonymous = anon_client.get(URL)
    assert anonymous.status_code == 401 and "images" not in anonymous.json()
    viewer = viewer_client.get(URL)
    assert viewer.status_code == 403 and "images" not in viewer.json()
    chat = APIClient()
    chat.credentials(HTTP_AUTHORIZATION=f"Bearer {chat_key}")
    assert chat.get(URL).status_code == 403
    assert agent.requests == []  # nothing went to the node for them
    admin = APIClient()
    admin.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    assert admin.get(URL).json()["images"] == [IMAGE]


@pytest.mark.django_db
def test_the_images_the_agent_lists(
    operator_client: APIClient, status_redis: object, agent: StubAgent
) -> None:
    set_status(make_node("n1", address="https://agent.example:9443"), "Online")
    answer = operator_client.get(URL)
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"node": "n1", "images": [IMAGE], "truncated": False}
    (sent,) = agent.requests
    assert sent.method == "GET" and sent.url == "https://agent.example:9443/agent/v1/images"
    assert MASTER_HEADER not in sent.headers  # a read: no fencing triple
    untagged = {**IMAGE, "tags": [], "digests": [], "createdAt": None}
    agent.answer = lambda request: httpx.Response(
        200, json={"images": [untagged], "truncated": True}
    )
    assert operator_client.get(URL).json() == {
        "node": "n1", "images": [untagged], "truncated": True,
    }  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("answer", "status", "code"),
    [
        (_refusal(501, "not_supported", "this node does not run containers"), 501,
         "not_supported"),
        (_refusal(503, "docker_unavailable", "the Docker engine does not answer"), 503,
         "docker_unavailable"),
        (_refusal(404, "not_found", "no such endpoint: GET /agent/v1/images"), 501,
         "not_supported"),
        (_refusal(500, "internal_error"), 502, "internal_error"),
        (lambda request: httpx.Response(200, json={"images": "all of them"}), 502,
         "unexpected_answer"),
        (_raises(httpx.ConnectError), 503, "node_unreachable"),
        (_raises(httpx.ReadTimeout), 503, "node_unreachable"),
    ],
    ids=["501", "docker-down", "older-agent", "500", "malformed", "unreachable", "timeout"],
)  # fmt: skip
def test_agent_errors_become_the_apis(
    operator_client: APIClient,
    status_redis: object,
    agent: StubAgent,
    answer: Answer,
    status: int,
    code: str,
) -> None:
    set_status(make_node("n1"), "Online")
    agent.answer = answer
    response = operator_client.get(URL)
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["code"] == code and "n1" in error["message"]
    assert "images" not in response.json()


@pytest.mark.django_db
def test_a_node_that_is_not_serving_is_not_asked(
    operator_client: APIClient, status_redis: object, agent: StubAgent
) -> None:
    def error(path: str = URL) -> tuple[int, str]:
        response = operator_client.get(path)
        return response.status_code, response.json()["error"]["code"]

    assert error("/api/nodes/nope/images") == (404, "not_found")
    node = make_node("n1")
    assert error() == (503, "node_not_serving")  # no status record: Offline
    set_status(node, "Offline")
    assert error() == (503, "node_not_serving")
    make_node("n2", approved=False)
    set_status(make_node("n3", revoked=True), "Online")
    assert error("/api/nodes/n2/images") == (503, "node_not_serving")
    assert error("/api/nodes/n3/images") == (503, "node_not_serving")
    assert agent.requests == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis")
async def test_a_real_agent_without_docker_says_not_supported(
    enrolled: Enrolled, operator_client: APIClient
) -> None:
    await sync_to_async(set_status)(enrolled.node, "Online")
    response = await sync_to_async(operator_client.get)(URL)
    assert response.status_code == 501, response.content
    error = response.json()["error"]
    assert error["code"] == "not_supported" and "DockerEnabled is false" in error["message"]
