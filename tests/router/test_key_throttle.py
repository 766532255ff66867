"""Failed key lookups per source address: /v1 and /api, 429 past 10, no Redis for valid keys."""

from __future__ import annotations

import logging

import httpx
import pytest
from rest_framework.test import APIClient

from router.app import RouterApp

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_db_after")]

CHAT = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}


def _client(app: RouterApp, address: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://router")


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _fail(client: httpx.AsyncClient, times: int) -> list[int]:
    statuses = []
    for i in range(times):
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers=_bearer(f"mbd-guess{i}")
        )
        statuses.append(response.status_code)
    return statuses


async def test_past_ten_failures_the_address_gets_429_before_any_lookup(
    chat_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = RouterApp()
    client = _client(app, "192.0.2.10")
    assert await _fail(client, 10) == [401] * 10
    from router import keys

    looked_up: list[str] = []
    original = keys.lookup

    def spy(token: str) -> object:
        looked_up.append(token)
        return original(token)

    monkeypatch.setattr(keys, "lookup", spy)
    refused = await client.post("/v1/chat/completions", json=CHAT, headers=_bearer(chat_key))
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "too_many_failed_keys" and error["type"] == "invalid_request_error"
    assert 890 <= int(refused.headers["retry-after"]) <= 900
    assert looked_up == []  # even a valid key is not looked up from a blocked address
    # Another address is not affected: its valid key reaches routing (404: no such model).
    other = await _client(app, "192.0.2.11").post(
        "/v1/chat/completions", json=CHAT, headers=_bearer(chat_key)
    )
    assert other.status_code == 404


async def test_another_process_learns_the_block_from_redis(chat_key: str) -> None:
    """A second web process (its own local cache) refuses at its first failed lookup."""
    from core import throttle

    assert await _fail(_client(RouterApp(), "192.0.2.20"), 10) == [401] * 10
    throttle.key_failures.forget()  # what a process that saw none of those failures knows
    statuses = await _fail(_client(RouterApp(), "192.0.2.20"), 2)
    assert statuses == [429, 429]


async def test_a_valid_key_costs_no_redis_round_trip(
    chat_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core import throttle

    calls: list[str] = []

    def no_redis(*args: object, **kwargs: object) -> object:
        calls.append("redis")
        raise AssertionError("the failure throttle asked Redis")

    monkeypatch.setattr(throttle.KeyFailureThrottle, "_aredis", no_redis)
    monkeypatch.setattr(throttle, "_redis", no_redis)
    client = _client(RouterApp(), "192.0.2.30")
    for _ in range(5):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=_bearer(chat_key))
        assert response.status_code == 404  # authenticated, then no such model
    no_key = await client.post("/v1/chat/completions", json=CHAT)
    assert no_key.status_code == 401  # nothing presented, nothing guessed: not counted
    assert calls == []


async def test_redis_unreachable_fails_open(
    chat_key: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import redis.asyncio as aioredis

    from core import throttle

    dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    monkeypatch.setattr(throttle.KeyFailureThrottle, "_aredis", lambda self: dead)
    caplog.set_level(logging.WARNING, logger="mirbad.auth")
    client = _client(RouterApp(), "192.0.2.40")
    assert await _fail(client, 12) == [401] * 12
    ok = await client.post("/v1/chat/completions", json=CHAT, headers=_bearer(chat_key))
    assert ok.status_code == 404
    messages = [r.getMessage() for r in caplog.records if r.name == "mirbad.auth"]
    assert sum(m.startswith("Redis unreachable") for m in messages) == 1
    assert sum(m.startswith("Failed API key lookup") for m in messages) == 12


async def test_failures_are_logged_with_the_address_and_prefix_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mirbad.auth")
    client = _client(RouterApp(), "192.0.2.50")
    secret = "mbd-AbCdEf-the-rest-of-a-secret"
    await client.post("/v1/chat/completions", json=CHAT, headers=_bearer(secret))
    lines = [r.getMessage() for r in caplog.records if r.name == "mirbad.auth"]
    assert len(lines) == 1
    assert "192.0.2.50" in lines[0] and "/v1/chat/completions" in lines[0]
    assert "mbd-AbCdEf" in lines[0] and "the-rest-of-a-secret" not in lines[0]


def test_api_bearer_failures_count_and_share_the_limit(admin_key: str) -> None:
    client = APIClient(REMOTE_ADDR="192.0.2.60")
    for i in range(10):
        client.credentials(HTTP_AUTHORIZATION=f"Bearer mbd-api-guess{i}")
        assert client.get("/api/nodes").status_code == 401
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    refused = client.get("/api/nodes")
    assert refused.status_code == 429
    assert 890 <= int(refused["Retry-After"]) <= 900
    assert "failed API key lookups" in refused.json()["error"]["message"]
    other = APIClient(REMOTE_ADDR="192.0.2.61")
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    assert other.get("/api/nodes").status_code == 200


async def test_api_failures_block_v1_too(chat_key: str) -> None:
    from asgiref.sync import sync_to_async

    def fail_on_api() -> None:
        client = APIClient(REMOTE_ADDR="192.0.2.70")
        for i in range(10):
            client.credentials(HTTP_AUTHORIZATION=f"Bearer mbd-api-guess{i}")
            assert client.get("/api/nodes").status_code == 401

    await sync_to_async(fail_on_api)()
    response = await _client(RouterApp(), "192.0.2.70").post(
        "/v1/chat/completions", json=CHAT, headers=_bearer(chat_key)
    )
    assert response.status_code == 429
