"""The monitor's steps against a real agent server in this process.

The agent's certificate comes from the master's own enrollment service and
CA, so the pinned TLS context is exercised exactly as in production.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import replace
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from nodes import services, status_cache
from nodes.agent_client import AgentUnreachable
from nodes.models import Node
from nodes.monitor import NodeWorker
from tests.nodes.conftest import Enrolled

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis"),
]


async def test_connect_takes_info_and_snapshot(enrolled: Enrolled) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        status = await status_cache.aread("n1")
        assert status is not None and status["state"] == "Online"
        assert status["bootId"] == enrolled.server.boot_id
        assert status["agentVersion"] == "0.1.0"
        assert abs(status["clockSkewSeconds"]) < 5
        stored = await sync_to_async(Node.objects.get)(node_id="n1")
        assert stored.os and stored.arch and stored.protocol_version == 1
        assert stored.facts["cpu"]["count"] >= 1 and "features" in stored.facts["cpu"]
        assert stored.facts["disks"] and stored.facts["gpus"] == []
        sample = await worker.client.telemetry()
        assert sample["memory"]["totalBytes"] > 0
    finally:
        await worker.client.aclose()


async def test_events_keep_the_node_in_contact(enrolled: Enrolled) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        before = worker.last_contact
        seen: list[str] = []

        async def follow() -> None:
            async for name, data in worker.client.events(read_timeout=5):
                await worker.handle_event(name, data)
                seen.append(name)
                if "heartbeat" in seen:
                    return

        await asyncio.wait_for(follow(), timeout=10)
        assert seen[0] == "hello" and "heartbeat" in seen
        cached = await status_cache.aread("n1")
        assert cached is not None and cached["telemetry"]["memory"]["totalBytes"] > 0
        assert worker.last_contact is not None and before is not None
        assert worker.last_contact >= before
    finally:
        await worker.client.aclose()


async def test_silent_node_goes_offline_after_15_seconds(enrolled: Enrolled) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        worker.connected = False
        assert worker.last_contact is not None
        await worker.recompute(now=worker.last_contact + 14)
        assert worker.status["state"] == "Online"
        await worker.recompute(now=worker.last_contact + 16)
        assert worker.status["state"] == "Offline"
    finally:
        await worker.client.aclose()


async def test_wrong_pin_is_refused_in_the_handshake(enrolled: Enrolled) -> None:
    node = enrolled.node
    node.spki_pin = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
    worker = NodeWorker(node=node, stop=asyncio.Event())
    try:
        with pytest.raises(AgentUnreachable, match="does not match the node's pin"):
            await worker.connect()
    finally:
        await worker.client.aclose()


async def test_another_node_id_is_refused(enrolled: Enrolled) -> None:
    node = enrolled.node
    node.node_id = "n2"  # we dial n1's address but expect n2
    worker = NodeWorker(node=node, stop=asyncio.Event())
    try:
        with pytest.raises(AgentUnreachable, match="not spiffe://mirbadllm/node/n2"):
            await worker.connect()
    finally:
        await worker.client.aclose()


async def test_no_common_protocol_is_incompatible(
    enrolled: Enrolled, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agent.http._server

    monkeypatch.setattr(agent.http._server, "PROTOCOL_VERSIONS", (99,))
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        status = await status_cache.aread("n1")
        assert status is not None and status["state"] == "Incompatible"
        assert "no common protocol version" in status["lastError"]
    finally:
        await worker.client.aclose()


async def test_revoked_node_is_refused_on_its_next_connection(enrolled: Enrolled) -> None:
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    await worker.connect()
    await worker.client.aclose()
    revoked = await sync_to_async(services.revoke_node)("n1")
    again = NodeWorker(node=revoked, stop=asyncio.Event())
    try:
        with pytest.raises(AgentUnreachable, match="certificate was refused"):
            await again.connect()
    finally:
        await again.client.aclose()


async def test_a_missed_fencing_event_is_caught_up_by_the_next_heartbeat(
    enrolled: Enrolled,
) -> None:
    """The agent accepted a new master while no event stream was open (a monitor takeover)."""
    worker = NodeWorker(node=enrolled.node, stop=asyncio.Event())
    try:
        await worker.connect()
        accepted = {"epoch": 7, "instanceId": "other-master", "bootId": "b2"}
        # What /info said before the agent moved on:
        worker.agent_fencing = {"epoch": 6, "instanceId": "old", "bootId": "b1"}
        heartbeat = {**enrolled.server._heartbeat_data(), "fencing": accepted}
        assert "fencing" in enrolled.server._heartbeat_data()  # the agent really sends it
        await worker.handle_event("heartbeat", heartbeat)
        cached = await status_cache.aread("n1")
        assert cached is not None and cached["fencing"] == accepted
    finally:
        await worker.client.aclose()


async def test_certificate_expiring_names_the_last_renewal_error(
    enrolled: Enrolled, settings: Any
) -> None:
    node = enrolled.node
    node.cert_not_after = dt.datetime.now(dt.UTC) + dt.timedelta(days=3)
    node.cert_renewal_error = "the proof connection to the new certificate failed: EOF"
    worker = NodeWorker(node=node, stop=asyncio.Event())
    try:
        expiring = [r for r in worker.reasons() if r["code"] == "certificate_expiring"]
        assert len(expiring) == 1
        assert "its renewal failed: the proof connection" in expiring[0]["message"]
        node.cert_not_after = dt.datetime.now(dt.UTC) + dt.timedelta(days=20)
        assert not [r for r in worker.reasons() if r["code"] == "certificate_expiring"]
        settings.MIRBAD = replace(settings.MIRBAD, cert_expiring_seconds=30 * 86400)
        assert [r for r in worker.reasons() if r["code"] == "certificate_expiring"]
    finally:
        await worker.client.aclose()


async def test_connect_writes_the_facts_only_when_they_changed(enrolled: Enrolled) -> None:
    """After a master restart every node reconnects with the facts its row holds: no
    write then (a thousand identical writes queued beside the connects)."""

    async def connect_with(node: Node) -> None:
        worker = NodeWorker(node=node, stop=asyncio.Event())
        try:
            await worker.connect()
        finally:
            await worker.client.aclose()

    await connect_with(enrolled.node)
    written = await sync_to_async(Node.objects.get)(node_id="n1")
    # The row changes behind the worker's back: a worker that knows the row as it was
    # written does not write it again...
    await sync_to_async(Node.objects.filter(node_id="n1").update)(os="marker")
    await connect_with(written)
    assert (await sync_to_async(Node.objects.get)(node_id="n1")).os == "marker"
    # ...and one that reads a row unlike the agent's facts writes them.
    await connect_with(await sync_to_async(Node.objects.get)(node_id="n1"))
    assert (await sync_to_async(Node.objects.get)(node_id="n1")).os == written.os != "marker"
