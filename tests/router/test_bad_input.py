"""Bodies that used to answer 500 on /v1 and /api: each is a 400 that names what was wrong."""

from __future__ import annotations

import httpx
import pytest
from rest_framework.test import APIClient

from router.app import RouterApp

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_db_after")]

NESTED = b"[" * 100_000


@pytest.fixture
def client() -> httpx.AsyncClient:
    # raise_app_exceptions=False: an unhandled error is the 500 a client would get.
    transport = httpx.ASGITransport(app=RouterApp(), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://router")


async def test_a_lone_surrogate_model_is_a_400_naming_model(
    client: httpx.AsyncClient, chat_key: str
) -> None:
    response = await client.post(
        "/v1/chat/completions",
        content=b'{"model": "\\ud800", "messages": []}',
        headers={"Authorization": f"Bearer {chat_key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "invalid_request"
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("body", [NESTED, b'{"model": "m", "messages": ' + NESTED + b"}"])
async def test_deep_nesting_is_a_400(client: httpx.AsyncClient, chat_key: str, body: bytes) -> None:
    response = await client.post(
        "/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {chat_key}"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "too deeply" in error["message"]


async def test_surrogates_elsewhere_in_the_body_are_forwarded_as_sent(
    client: httpx.AsyncClient, chat_key: str
) -> None:
    """Only ``model`` is the router's business: a surrogate in a message is the engine's."""
    response = await client.post(
        "/v1/chat/completions",
        content=b'{"model": "absent", "messages": [{"role": "user", "content": "\\ud800"}]}',
        headers={"Authorization": f"Bearer {chat_key}"},
    )
    assert response.status_code == 404  # routing went on: no such model


def _api_post(client: APIClient, path: str, body: bytes) -> object:
    return client.generic("POST", path, body, content_type="application/json")


def test_api_deep_nesting_is_a_400(operator_client: APIClient) -> None:
    response = _api_post(operator_client, "/api/models", NESTED)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "body" in error["message"]
    assert "too deeply" in error["message"]


def test_api_lone_surrogate_is_a_400_naming_the_field(operator_client: APIClient) -> None:
    response = _api_post(
        operator_client, "/api/keys", b'{"name": "ok", "scopes": ["chat"], "x": [1, "\\udfff"]}'
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("x[1]: must be text: no lone surrogate")
    response = _api_post(operator_client, "/api/keys", b'{"name": "\\ud800", "scopes": ["chat"]}')
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("name: ")
