"""The console's log websocket (console/log_consumer.py) against a real agent in this
process, enrolled through the master's own services (docs/decisions.md D62)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from agent.telemetry import install_agent_log
from console.log_consumer import LogConsumer
from nodes.models import Node
from tests.nodes.conftest import Enrolled, enrolled  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after"),
    pytest.mark.timeout(60),
]


def socket(node_id: str, name: str, user: Any) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(LogConsumer.as_asgi(), f"/ws/nodes/{node_id}/logs/{name}/")
    communicator.scope["user"] = user
    communicator.scope["url_route"] = {"kwargs": {"node_id": node_id, "name": name}}
    return communicator


async def test_anonymous_and_non_staff_users_are_refused(viewer: Any) -> None:
    for user in (AnonymousUser(), viewer):
        refused = socket("n1", "agent", user)
        connected, code = await refused.connect()
        assert not connected and code == 4401
        await refused.disconnect()


@pytest.mark.parametrize(
    ("node_id", "name"), [("N_1!", "agent"), ("n1", ".."), ("n1", "a b"), ("n1", "x" * 65)]
)
async def test_a_bad_node_id_or_log_name_is_4404(operator: Any, node_id: str, name: str) -> None:
    refused = socket(node_id, name, operator)
    connected, code = await refused.connect()
    assert not connected and code == 4404
    await refused.disconnect()


async def test_an_unknown_node_is_4404(operator: Any) -> None:
    refused = socket("n9", "agent", operator)
    connected, code = await refused.connect()
    assert not connected and code == 4404
    await refused.disconnect()


async def test_the_list_then_the_last_lines_then_a_new_line(
    operator: Any,
    enrolled: Enrolled,  # noqa: F811 - the fixture imported above
) -> None:
    install_agent_log()
    logger = logging.getLogger("mirbad.agent.test-console")
    logger.warning("an agent line from before")
    follower = socket("n1", "agent", operator)
    connected, _ = await follower.connect()
    assert connected
    try:
        listed = await follower.receive_json_from(timeout=10)
        assert listed == {"type": "log.list", "logs": [{"name": "agent", "kind": "agent"}]}
        first = await follower.receive_json_from(timeout=10)
        assert first["type"] == "log.lines" and first["name"] == "agent"
        assert first["lines"][-1]["text"].endswith("an agent line from before")
        # The follower long-polls now: a new line on the agent arrives by itself.
        logger.warning("a line while following")
        batch = await follower.receive_json_from(timeout=10)
        assert batch["type"] == "log.lines"
        assert batch["lines"][-1]["text"].endswith("a line while following")
        assert batch["lines"][0]["seq"] > first["lines"][-1]["seq"]
    finally:
        await follower.disconnect()


async def test_an_unknown_log_on_a_real_node_is_an_error_then_4404(
    operator: Any,
    enrolled: Enrolled,  # noqa: F811 - the fixture imported above
) -> None:
    follower = socket("n1", "m-404", operator)
    connected, _ = await follower.connect()
    assert connected  # the form is valid; only the agent knows its instances
    try:
        assert (await follower.receive_json_from(timeout=10))["type"] == "log.list"
        error = await follower.receive_json_from(timeout=10)
        assert error["type"] == "log.error" and "no log named 'm-404'" in error["message"]
        assert (await follower.receive_output(timeout=5)) == {
            "type": "websocket.close",
            "code": 4404,
        }
    finally:
        await follower.disconnect()


async def test_an_unreachable_agent_is_reported_and_retried(
    operator: Any,
    enrolled: Enrolled,  # noqa: F811 - the fixture imported above
) -> None:
    port = enrolled.server.port
    await enrolled.server.stop()  # the node is gone
    await sync_to_async(Node.objects.filter(node_id="n1").update)(
        address=f"https://127.0.0.1:{port}"
    )
    LogConsumer.retry_start = 0.1
    follower = socket("n1", "agent", operator)
    try:
        connected, _ = await follower.connect()
        assert connected
        first = await follower.receive_json_from(timeout=10)
        assert first["type"] == "log.error" and "trying again in 0.1 s" in first["message"]
        second = await follower.receive_json_from(timeout=10)
        assert second["type"] == "log.error" and "trying again in 0.2 s" in second["message"]
    finally:
        LogConsumer.retry_start = 1.0
        await follower.disconnect()


def test_the_panel_renders_with_its_script_and_escapes_its_names() -> None:
    from django.template.loader import render_to_string

    html = render_to_string("console/logs_panel.html", {"node_id": "n1", "log_name": 'm-1"><b>'})
    assert 'data-node="n1"' in html and 'data-log="m-1&quot;&gt;&lt;b&gt;"' in html
    assert '<script src="/static/console/logs.js" defer></script>' in html
    assert 'id="log-select"' in html and 'id="log-search"' in html
    assert 'id="log-lines"' in html and 'id="log-following"' in html
    assert "<script>" not in html  # no inline script (CSP)
    plain = render_to_string("console/logs_panel.html", {"node_id": "n1"})
    assert 'data-log="agent"' in plain
