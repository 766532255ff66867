"""Load on demand in the router (router/ondemand.py) against the test Redis.

Two Loader objects on two Redis connections stand for two web processes; the table
is a stand-in whose replica states the test sets, and the starter is a stand-in for
models_registry.ondemand.start_on_demand (tests/models_registry/test_ondemand.py
tests that one).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from core.errors import ServiceError
from nodes.models import Node
from router import ondemand
from router.errors import V1Error
from router.ondemand import Loader
from router.routing import Replica, Route


class FakeTable:
    """The two reads the loader makes of a RoutingTable: ready replicas and statuses."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.instance: dict[str, Any] | None = None

    async def ready_replicas(self, route: Route) -> list[Replica]:
        ready = self.instance is not None and self.instance.get("state") == "Ready"
        return list(route.replicas) if ready else []

    async def status(self, node_id: str) -> dict[str, Any]:
        instances = {self.route.replicas[0].instance_id: self.instance} if self.instance else {}
        return {"nodeId": node_id, "state": "Online", "instances": instances}


class Starter:
    """Counts the starts (from worker threads) and then does what the test says."""

    def __init__(self, table: FakeTable, then: str = "ready", delay: float = 0.3) -> None:
        self.table, self.then, self.delay = table, then, delay
        self.calls: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def __call__(self, model_id: int, actor: str) -> dict[str, Any]:
        with self.lock:
            self.calls.append((model_id, actor))
        if self.then == "refused":
            raise ServiceError(409, "admission_refused", "Model 'x' does not fit on node n1.")
        self.table.instance = {"state": "Starting", "startedAt": "t1"}

        def later() -> None:
            if self.then == "ready":
                self.table.instance = {"state": "Ready", "startedAt": "t1"}
            elif self.then == "fail":
                self.table.instance = {
                    "state": "Failed",
                    "startedAt": "t1",
                    "exitCode": 1,
                    "error": "the engine exited with code 1",
                    "logTail": [f"line {i}" for i in range(30)] + ["error: out of memory"],
                }

        threading.Timer(self.delay, later).start()
        return {"modelId": model_id, "instances": [], "evicted": []}


def _route(timeout: float = 10.0) -> Route:
    name = f"od-{uuid.uuid4().hex[:8]}"
    replica = Replica(node=Node(node_id="n1"), instance_id="m7-p1")
    return Route(model_id=7, served_name=name, replicas=(replica,), load_on_demand=True,
                 load_timeout=timeout)  # fmt: skip


@pytest.fixture
async def clients() -> AsyncIterator[list[aioredis.Redis]]:
    made = [aioredis.Redis.from_url(settings.MIRBAD.redis_url, decode_responses=True)
            for _ in range(2)]  # fmt: skip
    yield made
    async for name in made[0].scan_iter("mirbad:ondemand:*"):
        await made[0].delete(name)
    for client in made:
        await client.aclose()


async def test_many_requests_in_two_processes_start_the_model_once(
    clients: list[aioredis.Redis],
) -> None:
    route = _route()
    table = FakeTable(route)
    starter = Starter(table)
    loaders = [Loader(table, c, starter) for c in clients]  # type: ignore[arg-type]  # FakeTable
    waits = [loaders[i % 2].wait(route, actor=f"key {i}") for i in range(12)]
    waited = await asyncio.gather(*waits)
    assert len(starter.calls) == 1, starter.calls
    assert starter.calls[0][0] == 7
    assert all(w >= 0 for w in waited)
    # The lock is released once Ready: a later stop and request would start it again.
    assert await clients[0].get(ondemand.LOCK_PREFIX + route.served_name) is None


async def test_a_failed_load_answers_model_failed_with_the_log_and_holds_a_minute(
    clients: list[aioredis.Redis],
) -> None:
    route = _route()
    table = FakeTable(route)
    starter = Starter(table, then="fail")
    loaders = [Loader(table, c, starter) for c in clients]  # type: ignore[arg-type]  # FakeTable
    results = await asyncio.gather(
        *(loaders[i % 2].wait(route, actor="k") for i in range(4)), return_exceptions=True
    )
    assert len(starter.calls) == 1
    for result in results:
        assert isinstance(result, V1Error), result
        assert (result.status, result.code) == (503, "model_failed")
        assert "the engine exited with code 1" in result.message
        assert "error: out of memory" in result.message  # the engine's last log lines
        assert "line 29" in result.message and "line 0\n" not in result.message  # the last 12
        assert result.retry_after is not None and 55 <= result.retry_after <= 60
    ttl = await clients[0].ttl(ondemand.FAILED_PREFIX + route.served_name)
    assert 55 <= ttl <= 60
    # Within the minute, in either process: the same answer at once, no second start.
    table.instance = None
    for loader in loaders:
        with pytest.raises(V1Error) as again:
            await loader.wait(route, actor="k")
        assert again.value.code == "model_failed"
    assert len(starter.calls) == 1
    # Once the hold expires, a request tries again.
    await clients[0].delete(ondemand.FAILED_PREFIX + route.served_name)
    starter.then = "ready"
    await loaders[1].wait(route, actor="k")
    assert len(starter.calls) == 2


async def test_an_old_failed_record_is_not_this_starts_failure(
    clients: list[aioredis.Redis],
) -> None:
    route = _route()
    table = FakeTable(route)
    # Failed before, with the log of that start: this start goes on to Ready.
    table.instance = {"state": "Failed", "startedAt": "t0", "error": "old", "exitCode": 1}
    starter = Starter(table, then="ready")
    await Loader(table, clients[0], starter).wait(route, actor="k")  # type: ignore[arg-type]  # FakeTable
    assert len(starter.calls) == 1


async def test_a_refused_start_is_model_failed_with_the_reason(
    clients: list[aioredis.Redis],
) -> None:
    route = _route()
    table = FakeTable(route)
    starter = Starter(table, then="refused")
    with pytest.raises(V1Error) as refused:
        await Loader(table, clients[0], starter).wait(route, actor="k")  # type: ignore[arg-type]  # FakeTable
    assert refused.value.code == "model_failed"
    assert "does not fit on node n1" in refused.value.message


async def test_the_load_timeout_answers_model_load_timeout(
    clients: list[aioredis.Redis],
) -> None:
    route = _route(timeout=0.6)
    table = FakeTable(route)
    starter = Starter(table, then="stay", delay=0.05)  # Starting forever
    with pytest.raises(V1Error) as late:
        await Loader(table, clients[0], starter).wait(route, actor="k")  # type: ignore[arg-type]  # FakeTable
    assert (late.value.status, late.value.code) == (503, "model_load_timeout")
    assert "loadTimeoutSeconds (0.6 s)" in late.value.message
    assert len(starter.calls) == 1


async def test_a_stream_gets_keepalive_ticks_while_it_waits(
    clients: list[aioredis.Redis],
) -> None:
    route = _route()
    table = FakeTable(route)
    starter = Starter(table, then="ready", delay=0.8)
    ticks: list[float] = []

    async def tick() -> None:
        ticks.append(asyncio.get_running_loop().time())

    loader = Loader(table, clients[0], starter)  # type: ignore[arg-type]  # FakeTable
    await loader.wait(route, actor="k", tick=tick, first_tick=0.1, every=0.2)
    assert len(ticks) >= 2, ticks


async def test_an_unplaced_model_is_refused_at_once(clients: list[aioredis.Redis]) -> None:
    route = Route(model_id=7, served_name="nowhere", replicas=(), load_on_demand=True)
    table = FakeTable(route)
    starter = Starter(table)
    with pytest.raises(V1Error) as refused:
        await Loader(table, clients[0], starter).wait(route, actor="k")  # type: ignore[arg-type]  # FakeTable
    assert refused.value.code == "model_unplaced"
    assert starter.calls == []


# -- through the router app: the stream's keep-alive, then the failure as an SSE event ---


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis")
async def test_a_stream_waiting_for_a_failing_load_gets_comments_then_an_error_event(
    clients: list[aioredis.Redis], chat_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx
    from asgiref.sync import sync_to_async

    from models_registry.models import ModelDefinition
    from router.app import RouterApp
    from tests.factories import make_model, make_node, set_status

    def define() -> tuple[Node, str]:
        node = make_node("n1")
        model = make_model("lazy", node)
        ModelDefinition.objects.filter(pk=model.pk).update(load_on_demand=True)
        instance_id = model.placements.get().instance_id
        set_status(node, "Online", {instance_id: {"state": "Stopped"}})
        return node, instance_id

    node, instance_id = await sync_to_async(define)()
    starts: list[int] = []

    def start(model_id: int, actor: str) -> dict[str, Any]:
        starts.append(model_id)
        set_status(node, "Online", {instance_id: {"state": "Starting", "startedAt": "t1"}})
        failed = {"state": "Failed", "startedAt": "t1", "exitCode": 1,
                  "error": "the engine exited with code 1",
                  "logTail": ["llama_model_load: error loading model: bad magic"]}  # fmt: skip
        threading.Timer(1.5, lambda: set_status(node, "Online", {instance_id: failed})).start()
        return {"modelId": model_id, "instances": [], "evicted": []}

    monkeypatch.setattr(ondemand, "start", start)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=RouterApp()),
                               base_url="http://router", timeout=30)  # fmt: skip
    auth = {"Authorization": f"Bearer {chat_key}"}
    body = {"model": "lazy", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    try:
        streamed = await client.post("/v1/chat/completions", json=body, headers=auth)
        assert streamed.status_code == 200
        assert streamed.headers["content-type"] == "text/event-stream"
        events = [e for e in streamed.text.split("\n\n") if e]
        assert events[0] == ": loading lazy", events
        assert events[-1].startswith("data: "), events
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == "model_failed"
        assert "bad magic" in error["message"]
        # A plain request within the minute: the JSON error at once, no second start.
        plain = await client.post("/v1/chat/completions", json={**body, "stream": False},
                                  headers=auth)  # fmt: skip
        assert plain.status_code == 503
        assert plain.json()["error"]["code"] == "model_failed"
        assert "bad magic" in plain.json()["error"]["message"]
        assert 1 <= int(plain.headers["retry-after"]) <= 60
        assert len(starts) == 1
    finally:
        await client.aclose()


def test_with_the_queue_off_no_model_counts_as_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    assert ondemand.usage() is ondemand.USAGE
    monkeypatch.setattr(
        settings, "MIRBAD", dataclasses.replace(settings.MIRBAD, queue_enabled=False)
    )
    usage = ondemand.usage()
    assert usage.busy("anything") > 0 and usage.last_used("anything") is None
