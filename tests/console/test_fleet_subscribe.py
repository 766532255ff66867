"""/ws/fleet/'s fan-out: a page that subscribes to what it shows receives only their
events, a summary of the rest when it asks, and a bad subscribe closes the socket."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator

from console import consumers
from console.consumers import FleetConsumer
from nodes import events


def _node(node_id: str, state: str = "Online") -> events.NodeUpdated:
    return events.NodeUpdated(
        type="node.updated",
        node=events.NodeSummary(
            nodeId=node_id,
            state=state,
            reasons=[],
            cpuPercent=None,
            memoryPercent=None,
            memoryUsedBytes=None,
            memoryTotalBytes=None,
            lastSeen=None,
            approved=state != "PendingApproval",
            draining=False,
            maintenance=False,
        ),
    )


def _model(model_id: int) -> events.ModelUpdated:
    return events.ModelUpdated(
        type="model.updated",
        model=events.ModelSummary(
            modelId=model_id,
            servedName=f"m{model_id}",
            state="Ready",
            nodeId="a",
            error=None,
            restartCount=0,
            measuredBytes=None,
        ),
    )


def _download(node_id: str) -> events.DownloadUpdated:
    return events.DownloadUpdated(type="download.updated", nodeId=node_id, download={})


async def _socket(operator: Any, subscribe: dict[str, Any] | None) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(FleetConsumer.as_asgi(), "/ws/fleet/")
    communicator.scope["user"] = operator
    connected, _ = await communicator.connect()
    assert connected
    if subscribe is not None:
        await communicator.send_json_to({"type": "subscribe", **subscribe})
        ack = await communicator.receive_json_from(timeout=5)
        assert ack["type"] == "subscribed", ack
    return communicator


@pytest.mark.django_db(transaction=True)
async def test_a_page_subscribed_to_node_a_does_not_receive_node_bs_events(operator) -> None:
    page = await _socket(operator, {"nodes": ["node-a"], "models": [7]})
    everything = await _socket(operator, None)  # a page that never subscribes: all
    for event in (_node("node-b"), _download("node-b"), _model(8), _node("node-a"), _model(7)):
        await events.publish(event)
    got = [await page.receive_json_from(timeout=5) for _ in range(2)]
    assert [g["type"] for g in got] == ["node.updated", "model.updated"]
    assert got[0]["node"]["nodeId"] == "node-a" and got[1]["model"]["modelId"] == 7
    assert await page.receive_nothing(timeout=0.3)
    all_five = [await everything.receive_json_from(timeout=5) for _ in range(5)]
    assert [e["type"] for e in all_five].count("node.updated") == 2
    await page.disconnect()
    await everything.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_new_subscribe_replaces_the_old_and_pending_nodes_pass(operator) -> None:
    page = await _socket(operator, {"nodes": ["node-a"]})
    await page.send_json_to({"type": "subscribe", "nodes": ["node-b"], "pending": True})
    assert (await page.receive_json_from(timeout=5)) == {
        "type": "subscribed",
        "nodes": 1,
        "models": 0,
    }
    await events.publish(_node("node-a"))
    await events.publish(_node("new-c", state="PendingApproval"))  # enrolled: Approve shows
    await events.publish(_node("node-b"))
    first, second = [await page.receive_json_from(timeout=5) for _ in range(2)]
    assert first["node"]["nodeId"] == "new-c" and second["node"]["nodeId"] == "node-b"
    assert await page.receive_nothing(timeout=0.3)
    await page.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_events_held_back_become_one_fleet_changed_when_asked(
    operator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consumers, "SUMMARY_SECONDS", 0.3)
    overview = await _socket(operator, {"nodes": ["node-a"], "summary": True})
    quiet = await _socket(operator, {"nodes": ["node-a"]})
    for i in range(5):
        await events.publish(_node(f"other-{i}"))
    await events.publish(_model(3))
    assert (await overview.receive_json_from(timeout=5)) == {"type": "fleet.changed"}
    assert await overview.receive_nothing(timeout=0.6)  # coalesced: one for the burst
    assert await quiet.receive_nothing(timeout=0.1)
    await overview.disconnect()
    await quiet.disconnect()


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ("not json", "not JSON"),
        ('["subscribe"]', "the only message"),
        ('{"type": "hello"}', "the only message"),
        ('{"type": "subscribe", "node": ["a"]}', "unknown field(s): node"),
        ('{"type": "subscribe", "nodes": "a"}', "lists of ids"),
        ('{"type": "subscribe", "nodes": ["Bad Id"]}', "nodes: node ids"),
        ('{"type": "subscribe", "nodes": [1]}', "nodes: node ids"),
        ('{"type": "subscribe", "models": ["7"]}', "models: model ids"),
        ('{"type": "subscribe", "models": [true]}', "models: model ids"),
        ('{"type": "subscribe", "summary": "yes"}', "summary: true or false"),
        (
            json.dumps({"type": "subscribe", "nodes": [f"n{i}" for i in range(1001)]}),
            "at most 1000",
        ),
        (json.dumps({"type": "subscribe", "nodes": ["a" * 40] * 1600}), "at most 65536 characters"),
    ],
)
@pytest.mark.django_db(transaction=True)
async def test_a_bad_subscribe_is_refused_and_closes_with_4400(
    operator, message: str, says: str
) -> None:
    page = await _socket(operator, None)
    await page.send_to(text_data=message)
    refused = await page.receive_json_from(timeout=5)
    assert refused["type"] == "subscribe.refused" and says in refused["message"]
    closed = await page.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": 4400}
    await page.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_bytes_are_refused(operator) -> None:
    page = await _socket(operator, None)
    await page.send_to(bytes_data=b'{"type": "subscribe"}')
    assert (await page.receive_json_from(timeout=5))["type"] == "subscribe.refused"
    assert (await page.receive_output(timeout=5))["code"] == 4400
    await page.disconnect()
