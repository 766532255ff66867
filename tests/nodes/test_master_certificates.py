"""The master's own certificates are re-issued at half life inside running processes
(docs/decisions.md D53): the client certificate it dials agents with, in every
process that dials (contexts, the monitor's client, the router), and the enroll
listener's, without a restart and without dropping a connection.

Each test gets its own PKI directory and 30 s master certificates, first issued with
the clock 20 s behind, so they are past half life (but valid) when the test starts
and the next check at the real time re-issues them: nothing is issued in the future.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from cryptography import x509

from nodes import pki, services
from nodes.agent_client import AsyncAgentClient
from nodes.enroll_listener import EnrollTls, serve
from nodes.models import Node
from protocol.http_limits import HttpLimits

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@dataclass
class Clock:
    back_to_now: Callable[[], None]


@pytest.fixture
def short_master_certs(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Clock]:
    settings.MIRBAD = replace(
        settings.MIRBAD,
        data_path=tmp_path / "data",
        master_cert_seconds=30,
        pki_check_seconds=0.05,
    )
    real = pki._now
    monkeypatch.setattr(pki, "_now", lambda: real() - dt.timedelta(seconds=20))
    yield Clock(back_to_now=lambda: monkeypatch.setattr(pki, "_now", real))


def test_a_running_process_reissues_its_client_certificate(short_master_certs: Clock) -> None:
    node = Node(node_id="n1", spki_pin="a" * 64)
    first = services.master_pki()
    context = services.node_ssl_context(node)
    assert services.node_ssl_context(node) is context  # cached between checks
    short_master_certs.back_to_now()
    time.sleep(0.1)  # past MIRBAD_PKI_CHECK_SECONDS
    second = services.master_pki()
    assert second.client.serial != first.client.serial
    assert second.client.path == first.client.path  # one file, replaced whole
    assert second.client.not_after > first.client.not_after
    assert services.node_ssl_context(node) is not context  # new connections, new cert
    time.sleep(0.1)
    assert services.master_pki().client.serial == second.client.serial  # not before half life


async def test_the_monitors_client_follows_a_reissued_certificate(
    short_master_certs: Clock, enrolled: Any
) -> None:
    client = AsyncAgentClient(node=enrolled.node)
    try:
        assert (await client.info())["nodeId"] == "n1"
        first = client._serial
        short_master_certs.back_to_now()
        await asyncio.sleep(0.1)
        assert (await client.info())["nodeId"] == "n1"  # the agent takes the new one
        assert client._serial != first
        assert client._serial == (await sync_to_async(services.master_pki)()).client.serial
    finally:
        await client.aclose()


def _client_tls() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


@contextlib.asynccontextmanager
async def _listener() -> AsyncIterator[int]:
    tls = await sync_to_async(EnrollTls)()
    loop = asyncio.get_running_loop()
    started: asyncio.Future[int] = loop.create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve("127.0.0.1", 0, tls.context, HttpLimits(), started=started, stop=stop, tls=tls)
    )
    try:
        yield await asyncio.wait_for(started, 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def _peer_serial(port: int) -> int:
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_client_tls())
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()


async def _get_ca(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET /ca HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), 5)
    return head


async def test_the_enroll_listener_presents_a_reissued_certificate_without_a_restart(
    short_master_certs: Clock,
) -> None:
    async with _listener() as port:
        first = await _peer_serial(port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_client_tls())
        try:
            assert (await _get_ca(reader, writer)).startswith(b"HTTP/1.1 200")
            short_master_certs.back_to_now()
            serials: list[int] = []

            async def changed() -> bool:
                serials.append(await _peer_serial(port))
                return serials[-1] != first

            deadline = asyncio.get_running_loop().time() + 10
            while not await changed():
                assert asyncio.get_running_loop().time() < deadline, "never re-issued"
                await asyncio.sleep(0.05)
            leaf = pki.ensure_enroll_certificate(
                services.master_pki().ca, ["127.0.0.1"], lifetime=dt.timedelta(seconds=30)
            )
            assert serials[-1] == leaf.serial
            # The connection made under the old certificate is still served.
            assert (await _get_ca(reader, writer)).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
