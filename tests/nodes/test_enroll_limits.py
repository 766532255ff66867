"""The enroll listener's limits before authentication (issue 11), over TLS on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ssl
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from nodes.enroll_listener import serve
from protocol.http_limits import HttpLimits
from tests.http_attacks import (
    BIG_HEADER,
    COUNTED_HEADERS,
    MANY_HEADERS,
    closed_within,
    exchange,
    limits_server,
    request,
    rss_growth_under_unterminated_headers,
    status_of,
)

LIMITS = HttpLimits(head_timeout_seconds=1.0, body_idle_timeout_seconds=1.0, max_connections=20)


def server_context(folder: Path) -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "enroll")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "enroll.crt", folder / "enroll.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert_path), str(key_path))
    return context


def client_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


@contextlib.asynccontextmanager
async def enroll_listener(tmp_path: Path, limits: HttpLimits) -> AsyncIterator[int]:
    loop = asyncio.get_running_loop()
    started: asyncio.Future[int] = loop.create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve("127.0.0.1", 0, server_context(tmp_path), limits, started=started, stop=stop)
    )
    try:
        yield await asyncio.wait_for(started, 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def port(tmp_path: Path) -> AsyncIterator[int]:
    async with enroll_listener(tmp_path, LIMITS) as bound:
        yield bound


TLS = client_context()


async def test_a_normal_request_is_served(port: int) -> None:
    body = b"[1]"
    head = b"POST /enroll HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 3\r\n\r\n"
    answer = await exchange(port, head + body, context=TLS)
    assert status_of(answer) == 400 and b"must be a JSON object" in answer, answer


async def test_an_8_mb_header_is_431(port: int) -> None:
    answer = await exchange(port, BIG_HEADER, context=TLS)
    assert status_of(answer) == 431, answer[:200]


async def test_200000_headers_are_431(port: int) -> None:
    answer = await exchange(port, MANY_HEADERS, context=TLS)
    assert status_of(answer) == 431, answer[:200]


async def test_more_than_100_small_headers_are_431(port: int) -> None:
    answer = await exchange(port, COUNTED_HEADERS, context=TLS)
    assert status_of(answer) == 431 and b"more than 100 headers" in answer, answer[:200]


async def test_slowloris_is_closed_by_the_head_deadline(port: int) -> None:
    took, answer = await closed_within(
        port, b"POST /enroll HTTP/1.1\r\nHost: x\r\n", 4, context=TLS
    )
    assert status_of(answer) == 408 and 0.9 < took < 2.5, (took, answer)


async def test_a_stalled_tls_handshake_is_closed_by_the_head_deadline(port: int) -> None:
    took, answer = await closed_within(port, b"", 4)  # plain TCP: no ClientHello ever
    assert answer == b"" and took < 2.5, took


async def test_an_overstated_content_length_is_closed_by_the_body_deadline(port: int) -> None:
    head = b"POST /enroll HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    took, answer = await closed_within(port, head + b"{", 4, context=TLS)
    assert answer == b"" and 0.9 < took < 2.5, (took, answer)


async def test_connections_over_the_cap_get_503(tmp_path: Path) -> None:
    limits = replace(LIMITS, head_timeout_seconds=30.0, max_connections=3)
    async with enroll_listener(tmp_path, limits) as port:
        held = [await asyncio.open_connection("127.0.0.1", port, ssl=TLS) for _ in range(3)]
        await asyncio.sleep(0.1)
        took, answer = await closed_within(port, request(), 3, context=TLS)
        assert status_of(answer) == 503 and b"too many connections" in answer, answer
        assert took < 1.5
        held.pop()[1].close()
        await asyncio.sleep(0.2)
        answer = await exchange(
            port,
            request("/nothing").replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"),
            context=TLS,
        )
        assert status_of(answer) == 404, answer
        for _, writer in held:
            writer.close()


async def test_the_unterminated_headers_attack_stays_under_16_mib(tmp_path: Path) -> None:
    with limits_server("enroll", {"MIRBAD_DATA_PATH": str(tmp_path / "data")}) as (pid, port):
        growth = await rss_growth_under_unterminated_headers(pid, port)
    print(f"enroll: RSS growth {growth / 2**20:.1f} MiB under 16 x 16 MiB unterminated headers")
    assert growth < 16 * 2**20
