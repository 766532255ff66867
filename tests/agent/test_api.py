"""The agent API over mTLS: info, status, telemetry, events, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_support import RunningAgent, launch_body

from agent import __version__
from agent.state._events import EventBus
from agent.telemetry._host import HealthMonitor
from protocol.versions import PROTOCOL_VERSIONS

pytestmark = pytest.mark.timeout(30)


async def get_json(agent: RunningAgent, path: str) -> tuple[int, Any]:
    async with agent.session.get(agent.url(path)) as resp:
        return resp.status, await resp.json()


async def post_json(agent: RunningAgent, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with agent.session.post(agent.url(path), data=data, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_info(running_agent: RunningAgent) -> None:
    status, info = await get_json(running_agent, "/agent/v1/info")
    assert status == 200
    assert info["nodeId"] == "n1"
    assert info["agentVersion"] == __version__
    assert info["protocolVersions"] == list(PROTOCOL_VERSIONS)
    assert info["bootId"] == running_agent.server.boot_id
    assert info["time"].endswith("Z")
    assert info["cpuCount"] >= 1 and info["memoryTotalBytes"] > 0
    assert info["spkiSha256"] == running_agent.server.identity.spki_sha256
    assert info["executables"] == []
    assert "events" in info["features"]
    for key in ("os", "arch", "hostname"):
        assert isinstance(info[key], str)


async def test_status_and_telemetry(running_agent: RunningAgent) -> None:
    status, body = await get_json(running_agent, "/agent/v1/status")
    assert status == 200
    assert body["nodeId"] == "n1" and body["bootId"] == running_agent.server.boot_id
    assert body["health"] == {"reasons": []}
    assert body["instances"] == []
    status, tele = await get_json(running_agent, "/agent/v1/telemetry")
    assert status == 200
    assert set(tele) == {
        "time", "cpuPercent", "cpuPerCore", "cpuCount", "load", "memory", "disks", "gpus",
        "engines",
    }  # fmt: skip
    assert tele["engines"] == [] and tele["gpus"] == []
    assert len(tele["load"]) == 3
    assert tele["memory"]["totalBytes"] > 0
    paths = [d["path"] for d in tele["disks"]]
    config = running_agent.server.config
    assert paths == [str(config.models_root), str(config.state_directory)]


async def read_events(resp: aiohttp.ClientResponse, count: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    while len(events) < count:
        line = (await asyncio.wait_for(resp.content.readline(), 5)).decode().rstrip("\n")
        if not line:
            if current:
                events.append(current)
                current = {}
            continue
        name, _, value = line.partition(": ")
        current[name] = json.loads(value) if name == "data" else value
    return events


async def test_events_hello_heartbeat_and_instance(running_agent: RunningAgent) -> None:
    server = running_agent.server
    async with running_agent.session.get(running_agent.url("/agent/v1/events")) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        [hello] = await read_events(resp, 1)
        assert hello["event"] == "hello"
        assert hello["data"] == {"bootId": server.boot_id, "nodeId": "n1"}
        server.bus.publish("instance", {"instanceId": "m-9", "state": "Ready"})
        instance, beat = await read_events(resp, 2)
        assert instance["event"] == "instance" and instance["data"]["instanceId"] == "m-9"
        assert beat["event"] == "heartbeat" and beat["data"]["time"].endswith("Z")
        ids = [int(e["id"]) for e in (hello, instance, beat)]
        assert ids == sorted(ids) and len(set(ids)) == 3
        assert server.bus.subscriber_count == 1
    # A client that goes away releases its subscription.
    for _ in range(50):
        if server.bus.subscriber_count == 0:
            break
        await asyncio.sleep(0.05)
    assert server.bus.subscriber_count == 0


async def test_health_event_only_when_codes_change(tmp_path: Path) -> None:
    bus = EventBus()
    reasons: list[dict[str, str]] = []
    monitor = HealthMonitor(
        models_root=tmp_path,
        state_directory=tmp_path,
        bus=bus,
        interval=60,
        extra_checks=[lambda: list(reasons)],
    )
    with bus.subscribe() as sub:
        assert await monitor.refresh() is False
        reasons.append({"code": "executable_unverified", "message": "x"})
        assert await monitor.refresh() is True
        reasons[0] = {"code": "executable_unverified", "message": "changed text"}
        assert await monitor.refresh() is False
        reasons.clear()
        assert await monitor.refresh() is True
        first, second = await sub.get(), await sub.get()
    assert first is not None and second is not None
    assert first.type == "health" and first.data["reasons"][0]["code"] == "executable_unverified"
    assert second.data == {"reasons": []}


async def test_state_unavailable_reason(tmp_path: Path) -> None:
    monitor = HealthMonitor(
        models_root=tmp_path, state_directory=tmp_path / "missing", bus=EventBus(), interval=60
    )
    await monitor.refresh()
    assert [r["code"] for r in monitor.reasons] == ["state_unavailable"]


async def test_unknown_endpoint_and_method(running_agent: RunningAgent) -> None:
    async with running_agent.session.get(running_agent.url("/agent/v1/nope")) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
        assert resp.headers["x-mirbad-agent-error"] == "not_found"
    async with running_agent.session.put(running_agent.url("/agent/v1/info")) as resp:
        assert resp.status == 405
        assert (await resp.json())["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        ([1, 2], "JSON object"),
        ({**launch_body(), "instanceId": "bad id!"}, "'instanceId'"),
        ({k: v for k, v in launch_body().items() if k != "servedName"}, "'servedName'"),
        ({**launch_body(), "args": "-m x"}, "'args'"),
        ({**launch_body(), "env": {"A": 1}}, "'env'"),
        ({**launch_body(), "model": {"folder": "demo"}}, "'model.file'"),
        ({**launch_body(), "executable": {"version": None}}, "'executable.name'"),
    ],
)
async def test_launch_invalid_request(running_agent: RunningAgent, body: Any, needle: str) -> None:
    status, answer = await post_json(running_agent, "/agent/v1/instances", body)
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_request"
    assert needle in answer["error"]["message"]


@pytest.mark.parametrize(
    ("body", "code", "needle"),
    [
        (
            launch_body(args=["--alias", "d", "--port", "{port}", "--api-key", "x"]),
            "spec_rejected",
            "--api-key",
        ),
        (
            launch_body(args=["--alias", "d", "--host", "0.0.0.0", "--port", "{port}"]),
            "spec_rejected",
            "--host",
        ),
        (launch_body(model={"folder": "..", "file": "x"}), "spec_rejected", "model.folder"),
        (launch_body(runtime="vllm"), "spec_rejected", "runtime"),
        (launch_body(), "spec_rejected", "not configured"),
    ],
)
async def test_launch_guardrails(
    running_agent: RunningAgent, body: Any, code: str, needle: str
) -> None:
    status, answer = await post_json(running_agent, "/agent/v1/instances", body)
    assert status == 422, answer
    assert answer["error"]["code"] == code
    assert needle in answer["error"]["message"]


async def test_unknown_instance(running_agent: RunningAgent) -> None:
    status, body = await post_json(running_agent, "/agent/v1/instances/nope/stop", {})
    assert status == 404 and body["error"]["code"] == "not_found"
    async with running_agent.session.delete(running_agent.url("/agent/v1/instances/nope")) as r:
        assert r.status == 404
    async with running_agent.session.get(running_agent.url("/agent/v1/proxy/nope/v1/models")) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "not_found"


async def test_mutations_finish_when_the_client_hangs_up() -> None:
    from agent.http._complete import complete as _complete

    finished = asyncio.Event()

    async def mutation() -> str:
        await asyncio.sleep(0.1)
        finished.set()
        return "done"

    handler = asyncio.ensure_future(_complete(mutation()))
    await asyncio.sleep(0.01)
    handler.cancel()  # what aiohttp does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await handler
    await asyncio.wait_for(finished.wait(), 2)


async def test_heartbeats_carry_the_telemetry_sample_when_asked(
    running_agent: RunningAgent,
) -> None:
    """?telemetry=1: the master needs no /telemetry request per node every 5 s."""
    url = running_agent.url("/agent/v1/events")
    async with running_agent.session.get(url, params={"telemetry": "1"}) as resp:
        assert resp.status == 200
        _hello, beat = await read_events(resp, 2)
        assert beat["event"] == "heartbeat"
        sample = beat["data"]["telemetry"]
        assert sample["memory"]["totalBytes"] > 0 and sample["engines"] == []
    async with running_agent.session.get(url) as resp:
        _hello, beat = await read_events(resp, 2)
        assert "telemetry" not in beat["data"]  # not asked: as before
    for query, says in (({"telemetry": "yes"}, "telemetry: 0 or 1"), ({"x": "1"}, "'x'")):
        async with running_agent.session.get(url, params=query) as resp:
            assert resp.status == 400
            body = await resp.json()
            assert body["error"]["code"] == "invalid_request" and says in body["error"]["message"]
    async with running_agent.session.get(running_agent.url("/agent/v1/info")) as resp:
        assert "events.telemetry" in (await resp.json())["features"]
