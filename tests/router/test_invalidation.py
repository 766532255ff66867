"""Cached keys and routes are dropped in every router process when they change."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from asgiref.sync import sync_to_async
from rest_framework.test import APIClient

from router.app import RouterApp
from router.models import ApiKey
from tests.factories import make_model, make_node, set_status

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis"),
]


def chat(model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_revoked_key_stops_working_in_every_process_within_a_second(
    chat_key: str, admin_key: str
) -> None:
    apps = [RouterApp(), RouterApp()]  # two web processes' routers, one shared Redis
    clients = [
        httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://r") for a in apps
    ]
    headers = {"Authorization": f"Bearer {chat_key}"}
    node = await sync_to_async(make_node)("n1")
    await sync_to_async(make_model)("m", node)
    await sync_to_async(set_status)(node, "Offline")
    for client in clients:
        # Authenticated (and cached): the model's node is offline, so 503, not 401.
        response = await client.post("/v1/chat/completions", json=chat(), headers=headers)
        assert response.status_code == 503, response.text
    for app in apps:
        app.listener.start()  # uvicorn's lifespan startup does this in a web process
        await asyncio.wait_for(app.listener.ready.wait(), 5)

    key_id = await sync_to_async(lambda: ApiKey.objects.get(name="chat").pk)()
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    revoked = await sync_to_async(api.delete)(f"/api/keys/{key_id}")
    assert revoked.status_code in (200, 204), revoked.content
    started = time.monotonic()
    for client in clients:
        while True:
            response = await client.post("/v1/chat/completions", json=chat(), headers=headers)
            if response.status_code == 401:
                break
            assert time.monotonic() - started < 1.0, "the revoked key still worked after 1 s"
            await asyncio.sleep(0.02)
    for app, client in zip(apps, clients, strict=True):
        await client.aclose()
        await app.listener.stop()
    from channels.layers import get_channel_layer

    await get_channel_layer().close_pools()  # its connections belong to this test's loop


async def test_a_new_placement_is_seen_without_waiting_for_the_ttl(chat_key: str) -> None:
    app = RouterApp()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
    headers = {"Authorization": f"Bearer {chat_key}"}
    model = await sync_to_async(make_model)("m")
    unplaced = await client.post("/v1/chat/completions", json=chat(), headers=headers)
    assert unplaced.json()["error"]["code"] == "model_unplaced"
    app.listener.start()
    await asyncio.wait_for(app.listener.ready.wait(), 5)
    node = await sync_to_async(make_node)("n1")
    await sync_to_async(set_status)(node, "Offline")
    from models_registry.models import Placement

    await sync_to_async(Placement.objects.create)(model=model, node=node)
    started = time.monotonic()
    while True:
        response = await client.post("/v1/chat/completions", json=chat(), headers=headers)
        if response.json()["error"]["code"] == "node_offline":
            break
        assert time.monotonic() - started < 1.0, response.json()
        await asyncio.sleep(0.02)
    await client.aclose()
    await app.listener.stop()
    from channels.layers import get_channel_layer

    await get_channel_layer().close_pools()


async def test_the_listener_stays_subscribed_while_nothing_changes(
    chat_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A receive with nothing to read used to fail after redis-py 8's 5 s read timeout:
    # the listener dropped every cache and resubscribed, and changes published while it
    # was away were lost. Idle past that wait, it must still be the same subscription.
    from channels_redis.core import RedisChannelLayer

    app = RouterApp()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
    headers = {"Authorization": f"Bearer {chat_key}"}
    node = await sync_to_async(make_node)("n1")
    await sync_to_async(make_model)("m", node)
    await sync_to_async(set_status)(node, "Offline")
    app.listener.start()
    await asyncio.wait_for(app.listener.ready.wait(), 5)
    with caplog.at_level("WARNING", logger="mirbad.router"):
        await asyncio.sleep(RedisChannelLayer.brpop_timeout + 1.5)
    assert app.listener.ready.is_set()
    assert not [r for r in caplog.records if "listener failed" in r.getMessage()]
    response = await client.post("/v1/chat/completions", json=chat(), headers=headers)
    assert response.status_code == 503, response.text
    await client.aclose()
    await app.listener.stop()
    from channels.layers import get_channel_layer

    await get_channel_layer().close_pools()
