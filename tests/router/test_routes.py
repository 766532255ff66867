"""/v1 through a route (an alias): the first target that can take the request, else the next.

The agent here is a real TLS peer holding an enrolled node's identity (as in
tests/router/test_upstream_timeout.py): it answers every proxied request with a small
JSON naming the instance it was sent to and the ``model`` the body carried, or, for the
instances told to, the agent's "model not running" refusal (a failure before the first
byte, which the router retries elsewhere).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async

from agent.identity._tls import load_identity, server_ssl_context
from models_registry import routes
from models_registry.models import ModelDefinition, Placement
from protocol.errors import ERROR_HEADER
from router import keys, metrics
from router.app import RouterApp
from tests.factories import make_model, set_status
from tests.nodes.conftest import _enroll

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis"),
    pytest.mark.timeout(60),
]


@dataclasses.dataclass
class Agent:
    """The peer: ``bodies`` holds (instance, body) of every request it received."""

    node: Any = None
    instances: dict[str, str] = dataclasses.field(default_factory=dict)  # served -> instance
    refuse: set[str] = dataclasses.field(default_factory=set)  # instances answering "not running"
    bodies: list[tuple[str, bytes]] = dataclasses.field(default_factory=list)

    def ready(self, *served: str) -> None:
        """Only these models' instances are Ready; the others are Starting."""
        set_status(
            self.node,
            "Online",
            {
                i: {"state": "Ready" if s in served else "Starting"}
                for s, i in self.instances.items()
            },
        )

    def served_by(self) -> list[str]:
        by_instance = {i: s for s, i in self.instances.items()}
        return [by_instance[i] for i, _ in self.bodies]


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    target = lines[0].split(b" ")[1].decode()
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return target, await reader.readexactly(length)


def _answer(status: int, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    state = tmp_path / "state"
    node = await sync_to_async(_enroll)(state)
    context = server_ssl_context(load_identity(state, node_id=node.node_id))
    peer = Agent(node=node)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # the router's pool keeps connections alive
                target, body = await _read_request(reader)
                instance = target.split("/")[4]  # /agent/v1/proxy/{instance}/v1/...
                if instance in peer.refuse:
                    error = {"error": {"code": "model_not_running", "message": "not running"}}
                    writer.write(_answer(409, json.dumps(error).encode(),
                                         f"{ERROR_HEADER}: model_not_running\r\n"))  # fmt: skip
                else:
                    peer.bodies.append((instance, body))
                    answer = {"instance": instance, "model": json.loads(body)["model"],
                              "usage": {"prompt_tokens": 3, "completion_tokens": 2}}  # fmt: skip
                    writer.write(_answer(200, json.dumps(answer).encode()))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()  # the router closed its connection, or the test ended

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    node.address = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    await sync_to_async(node.save)()
    for served in ("a", "b", "c"):
        model = await sync_to_async(make_model)(served, node)
        placement = await sync_to_async(lambda m=model: m.placements.get())()
        peer.instances[served] = placement.instance_id
    try:
        yield peer
    finally:
        server.close()


@pytest.fixture
async def router() -> AsyncIterator[tuple[RouterApp, httpx.AsyncClient]]:
    app = RouterApp()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    try:
        yield app, client
    finally:
        await client.aclose()
        await app.limiter().stop()
        for queue in app._queues.values():
            await queue.stop()


async def _ready(app: RouterApp, agent: Agent, *served: str) -> None:
    """Only ``served`` are Ready, and the router reads it now (the monitor's status
    message does that in a running master)."""
    await sync_to_async(agent.ready)(*served)
    app.apply({"type": "router.invalidate", "kind": "statuses"})


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def _fallbacks(route: str, served: str) -> float:
    value = metrics.METRICS.registry.get_sample_value(
        "mirbad_v1_route_fallbacks_total", {"route": route, "served": served}
    )
    return value or 0.0


async def test_the_first_ready_target_answers_and_a_stopped_first_falls_back(
    agent: Agent,
    router: tuple[RouterApp, httpx.AsyncClient],
    chat_key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, client = router
    await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a", "b"]})
    await _ready(app, agent, "a", "b")
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(chat_key))
    assert answer.status_code == 200, answer.text
    # The engine is asked for its own served name (vLLM checks it), not the alias.
    assert answer.json()["model"] == "a" and agent.served_by() == ["a"]
    assert _fallbacks("alias", "b") == 0

    await _ready(app, agent, "b")  # a stopped: b takes it
    before = _fallbacks("alias", "b")
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(chat_key))
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "b" and agent.served_by() == ["a", "b"]
    assert _fallbacks("alias", "b") == before + 1
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Route alias")]
    assert len(logged) == 1 and "skipped 'a' (" in logged[0], logged  # with why
    assert logged[0].endswith("served by 'b'"), logged
    # Usage is metered by the served name that answered.
    metered = {bucket[2]: counts for bucket, counts in app.meter.pending().items()}
    assert set(metered) == {"a", "b"}


async def test_a_served_name_is_forwarded_byte_for_byte(
    agent: Agent, router: tuple[RouterApp, httpx.AsyncClient], chat_key: str
) -> None:
    app, client = router
    await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a"]})
    await _ready(app, agent, "a")
    raw = b'{ "model" : "a",  "messages": [{"role": "user", "content": "hi"}] }'
    answer = await client.post(
        "/v1/chat/completions",
        content=raw,
        headers={**_auth(chat_key), "Content-Type": "application/json"},
    )
    assert answer.status_code == 200, answer.text
    assert agent.bodies[-1][1] == raw


async def test_a_failure_before_the_first_byte_moves_to_the_next_target(
    agent: Agent, router: tuple[RouterApp, httpx.AsyncClient], chat_key: str
) -> None:
    app, client = router
    await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a", "b", "c"]})
    await _ready(app, agent, "a", "b", "c")
    agent.refuse = {agent.instances["a"], agent.instances["b"]}  # Ready, but not running
    before = _fallbacks("alias", "c")
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(chat_key))
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "c"
    assert _fallbacks("alias", "c") == before + 1


async def test_when_no_target_can_take_it_the_first_ones_error_is_the_clients(
    agent: Agent, router: tuple[RouterApp, httpx.AsyncClient], chat_key: str
) -> None:
    app, client = router
    await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a", "b"]})
    await _ready(app, agent)
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(chat_key))
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "model_not_ready" and "'a'" in error["message"]
    # The last target refusing before its first byte: its error, not a generic one.
    await _ready(app, agent, "a", "b")
    agent.refuse = {agent.instances["a"], agent.instances["b"]}
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(chat_key))
    assert answer.status_code == 503 and "'b'" in answer.json()["error"]["message"]


async def test_the_allowlist_applies_to_the_name_called(
    agent: Agent, router: tuple[RouterApp, httpx.AsyncClient]
) -> None:
    app, client = router
    await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a", "b"]})
    await _ready(app, agent, "b")
    _, key = await sync_to_async(keys.create_key)(
        name="only-alias", scopes=["chat"], model_allowlist=["alias"]
    )
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(key))
    assert answer.status_code == 200 and answer.json()["model"] == "b"
    direct = await client.post("/v1/chat/completions", json=_chat("b"), headers=_auth(key))
    assert direct.status_code == 403 and direct.json()["error"]["code"] == "model_not_allowed"
    listed = await client.get("/v1/models", headers=_auth(key))
    assert [m["id"] for m in listed.json()["data"]] == ["alias"]


async def test_v1_models_lists_a_route_while_a_target_is_ready(
    agent: Agent, router: tuple[RouterApp, httpx.AsyncClient], chat_key: str
) -> None:
    app, client = router
    await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a", "b"]})
    await _ready(app, agent, "b")
    listed = await client.get("/v1/models", headers=_auth(chat_key))
    assert [m["id"] for m in listed.json()["data"]] == ["b", "alias"]
    await _ready(app, agent, "c")
    listed = await client.get("/v1/models", headers=_auth(chat_key))
    assert [m["id"] for m in listed.json()["data"]] == ["c"]


async def test_a_repointed_route_is_followed_once_announced(
    agent: Agent, router: tuple[RouterApp, httpx.AsyncClient], chat_key: str
) -> None:
    app, client = router
    row = await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a"]})
    await _ready(app, agent, "a", "b")
    assert [r.served_name for r in await app.table.candidates("alias")] == ["a"]
    await sync_to_async(routes.update_route)(row, {"targets": ["b", "a"]})
    # Cached until the change is announced (router.signals, on commit).
    assert [r.served_name for r in await app.table.candidates("alias")] == ["a"]
    app.apply({"type": "router.invalidate", "kind": "routes", "name": "alias"})
    assert [r.served_name for r in await app.table.candidates("alias")] == ["b", "a"]
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(chat_key))
    assert answer.json()["model"] == "b"
    # A rename drops the old name too.
    await sync_to_async(routes.update_route)(row, {"name": "renamed"})
    app.apply({"type": "router.invalidate", "kind": "routes", "name": "alias"})
    assert await app.table.candidates("alias") == []


async def test_a_target_removed_behind_the_services_back_is_skipped(
    agent: Agent, router: tuple[RouterApp, httpx.AsyncClient], chat_key: str
) -> None:
    """Deleting a routed model is refused; a row removed anyway is skipped, not a 500."""
    app, client = router
    await sync_to_async(routes.create_route)({"name": "alias", "targets": ["a", "b"]})
    await _ready(app, agent, "a", "b")
    await sync_to_async(lambda: Placement.objects.filter(model__served_name="a").delete())()
    await sync_to_async(lambda: ModelDefinition.objects.filter(served_name="a").delete())()
    app.apply({"type": "router.invalidate", "kind": "routes", "name": None})
    answer = await client.post("/v1/chat/completions", json=_chat("alias"), headers=_auth(chat_key))
    assert answer.status_code == 200 and answer.json()["model"] == "b"
