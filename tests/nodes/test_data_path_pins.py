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

from nodes.services import node_ssl_context
from protocol.errors import ConnectFailed
from protocol.wire import WirePool
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


async def _twice(first: Any, second: Any, port: int) -> tuple[int, int, BaseException | None]:
    """One pool: a request with ``first``, then one with ``second``; connections made."""
    pool = WirePool(connect_timeout=5)
    try:
        response = await pool.request("GET", "127.0.0.1", port, "/agent/v1/info", ssl_context=first)
        await response.read()
        kept = pool.connections  # the first connection, idle in the pool
        try:
            response = await pool.request(
                "GET", "127.0.0.1", port, "/agent/v1/info", ssl_context=second
            )
            await response.read()
        except ConnectFailed as exc:
            return response.status, kept, exc
        return response.status, kept, None
    finally:
        await pool.close()


async def test_a_rekeyed_node_gets_no_connection_verified_under_its_old_pin(
    enrolled: Enrolled,
) -> None:
    """The router builds a new context when a node's pins change (router.app); the pool
    keys connections by context, so the old one is never handed to a request under the
    new pin: the new pin is checked in a new handshake (here a wrong pin, so it fails)."""
    node = enrolled.node
    old = await sync_to_async(node_ssl_context)(node)
    node.spki_pin = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
    new = await sync_to_async(node_ssl_context)(node)
    status, kept, error = await _twice(old, new, enrolled.server.port)
    assert status == 200 and kept == 1
    assert isinstance(error, ConnectFailed), "the old pin's connection was reused"
