"""The /v1 data path (the wire client) checks the node's identity in the handshake too.

The router dials agents with ``node_ssl_context`` (D4), whose SSLObject subclass
verifies the SAN and the SPKI pin during the handshake. The router runs on uvloop,
which has its own TLS implementation, so both loops are tried.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from asgiref.sync import sync_to_async

from agent import ConnectFailed, WirePool
from nodes.services import node_ssl_context
from tests.nodes.conftest import Enrolled

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_db_after")]


async def _info(context: Any, port: int) -> int:
    pool = WirePool(connect_timeout=5)
    try:
        response = await pool.request(
            "GET", "127.0.0.1", port, "/agent/v1/info", ssl_context=context
        )
        await response.read()
        return response.status
    finally:
        await pool.close()


async def _on(loop_factory: Callable[[], asyncio.AbstractEventLoop], work: Coroutine) -> Any:
    """Run ``work`` on a loop of its own in a thread (the agent serves on this one)."""

    def run() -> Any:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(work)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, run)


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
async def test_the_right_pin_passes_and_a_wrong_one_sends_nothing(
    enrolled: Enrolled, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    node = enrolled.node
    port = enrolled.server.port
    good = await sync_to_async(node_ssl_context)(node)
    assert await _on(loop_factory, _info(good, port)) == 200
    node.spki_pin = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
    bad = await sync_to_async(node_ssl_context)(node)
    with pytest.raises(ConnectFailed, match="does not match the node's pin"):
        await _on(loop_factory, _info(bad, port))
