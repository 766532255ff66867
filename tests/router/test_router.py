"""/v1 errors in the OpenAI shape, decided from the registry and the status cache."""

from __future__ import annotations

import httpx
import pytest

from router.app import MAX_BODY, RouterApp
from tests.factories import make_model, make_node, set_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_db_after")]


@pytest.fixture
def client() -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=RouterApp())
    return httpx.AsyncClient(transport=transport, base_url="http://router")


def _chat(model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def _err(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_missing_and_bad_key_401(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=_chat())
    assert response.status_code == 401 and _err(response)["code"] == "invalid_api_key"
    response = await client.post(
        "/v1/chat/completions", json=_chat(), headers={"Authorization": "Bearer mbd-wrong"}
    )
    assert response.status_code == 401
    assert "x-mirbad-overhead-ms" in response.headers


async def test_unknown_model_404(client: httpx.AsyncClient, chat_key: str) -> None:
    response = await client.post(
        "/v1/chat/completions", json=_chat("nope"), headers={"Authorization": f"Bearer {chat_key}"}
    )
    assert response.status_code == 404
    assert _err(response)["code"] == "model_not_found"
    assert "'nope'" in _err(response)["message"]


async def test_unplaced_model(client: httpx.AsyncClient, chat_key: str) -> None:
    await _sync(make_model, "m")
    response = await client.post(
        "/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {chat_key}"}
    )
    assert response.status_code == 503 and _err(response)["code"] == "model_unplaced"


async def test_node_offline_503_with_retry_after(
    client: httpx.AsyncClient, chat_key: str, status_redis: object
) -> None:
    node = await _sync(make_node, "n1")
    await _sync(make_model, "m", node)
    response = await client.post(
        "/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {chat_key}"}
    )
    assert response.status_code == 503 and _err(response)["code"] == "node_offline"
    assert response.headers["retry-after"] == "30"


async def test_model_not_ready_503(
    client: httpx.AsyncClient, chat_key: str, status_redis: object
) -> None:
    node = await _sync(make_node, "n1")
    model = await _sync(make_model, "m", node)
    placement = await _sync(lambda: model.placements.get())
    await _sync(set_status, node, "Online", {placement.instance_id: {"state": "Starting"}})
    response = await client.post(
        "/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {chat_key}"}
    )
    assert response.status_code == 503 and _err(response)["code"] == "model_not_ready"
    assert response.headers["retry-after"] == "30"


async def test_stale_status_counts_as_offline(
    client: httpx.AsyncClient, chat_key: str, status_redis: object
) -> None:
    import time

    from nodes import status_cache

    node = await _sync(make_node, "n1")
    model = await _sync(make_model, "m", node)
    placement = await _sync(lambda: model.placements.get())
    await _sync(
        status_cache.write,
        {
            "nodeId": "n1",
            "state": "Online",
            "lastSeen": time.time() - 60,
            "instances": {placement.instance_id: {"state": "Ready"}},
        },
    )
    response = await client.post(
        "/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {chat_key}"}
    )
    assert _err(response)["code"] == "node_offline"


async def test_body_limits_and_shape(client: httpx.AsyncClient, chat_key: str) -> None:
    auth = {"Authorization": f"Bearer {chat_key}"}
    big = await client.post(
        "/v1/chat/completions",
        content=b"x",
        headers={**auth, "Content-Length": str(MAX_BODY + 1)},
    )
    assert big.status_code == 413 and _err(big)["code"] == "request_too_large"

    async def chunks():  # chunked upload above the limit, never held whole
        piece = b"x" * (1024 * 1024)
        for _ in range(65):
            yield piece

    chunked = await client.post("/v1/chat/completions", content=chunks(), headers=auth)
    assert chunked.status_code == 413
    no_model = await client.post("/v1/chat/completions", json={"messages": []}, headers=auth)
    assert no_model.status_code == 400 and _err(no_model)["param"] == "model"
    not_json = await client.post("/v1/chat/completions", content=b"{", headers=auth)
    assert not_json.status_code == 400


async def test_scope_and_unknown_endpoint(client: httpx.AsyncClient, db: object) -> None:
    from router import keys

    _, key = await _sync(keys.create_key, name="emb", scopes=["embeddings"])
    auth = {"Authorization": f"Bearer {key}"}
    response = await client.post("/v1/chat/completions", json=_chat(), headers=auth)
    assert response.status_code == 403 and _err(response)["code"] == "scope_not_allowed"
    response = await client.post("/v1/nothing", json=_chat(), headers=auth)
    assert response.status_code == 404


async def test_models_lists_ready_only(
    client: httpx.AsyncClient, chat_key: str, status_redis: object
) -> None:
    node = await _sync(make_node, "n1")
    ready = await _sync(make_model, "ready-one", node)
    await _sync(make_model, "starting-one", node)
    placement = await _sync(lambda: ready.placements.get())
    await _sync(set_status, node, "Online", {placement.instance_id: {"state": "Ready"}})
    response = await client.get("/v1/models", headers={"Authorization": f"Bearer {chat_key}"})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["ready-one"]


async def _sync(fn, *args, **kwargs):
    from asgiref.sync import sync_to_async

    return await sync_to_async(fn)(*args, **kwargs)


async def test_an_error_after_admission_is_counted_in_the_keys_usage(
    chat_key: str, status_redis: object
) -> None:
    """The request is metered once, and its error beside it (the usage page's errors)."""
    app = RouterApp()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    node = await _sync(make_node, "n1")
    model = await _sync(make_model, "m", node)
    placement = await _sync(lambda: model.placements.get())
    await _sync(set_status, node, "Online", {placement.instance_id: {"state": "Starting"}})
    response = await client.post(
        "/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {chat_key}"}
    )
    assert response.status_code == 503
    pending = app.meter.pending()
    assert [(bucket[2], counts) for bucket, counts in pending.items()] == [("m", (1, 0, 0, 1))]
