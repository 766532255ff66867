"""The agent's half of a certificate rotation (issue 13): /agent/v1/pki/rotations over a
real AgentServer and real TLS, and RotationStore's recovery after a crash at each
point (docs/agent-api.md, "Certificate rotation")."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent._config import AgentConfig
from agent.http._server import AgentServer
from agent.identity import RotationStore, bootstrap_enroll, load_identity
from agent.identity._rotation import PENDING_CERT_FILE, PENDING_KEY_FILE, ROTATION_FILE, Stage
from protocol.identity import node_spiffe_id, spki_sha256
from tests.agent.agent_support import (
    Pki,
    RunningAgent,
    client_context,
    issue,
    make_identity,
    master_headers,
)

pytestmark = pytest.mark.timeout(60)

NODE_EKU = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


def _rid() -> str:
    return "r-" + uuid.uuid4().hex


def _sign(pki: Pki, csr_pem: str, *, node_id: str = "n1", ca: Any = None,
          eku: list[x509.ObjectIdentifier] | None = None) -> str:  # fmt: skip
    """What the master signs for the CSR (a test CA here)."""
    csr = x509.load_pem_x509_csr(csr_pem.encode())
    cert = issue(
        ca or pki.ca,
        cn=node_id,
        uris=[node_spiffe_id(node_id)],
        eku=NODE_EKU if eku is None else eku,
        public_key=csr.public_key(),  # type: ignore[arg-type]  # a P-256 CSR
    ).cert
    return cert.public_bytes(serialization.Encoding.PEM).decode()


async def _presented(agent: RunningAgent) -> str:
    """The pin of the certificate a new connection to the agent is shown."""
    context = client_context(agent.pki, agent.pki.master, agent.tmp / "fresh")
    _, writer = await asyncio.open_connection("127.0.0.1", agent.server.port, ssl=context)
    try:
        return spki_sha256(writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
    finally:
        writer.close()


@pytest.fixture
async def fresh(running_agent: RunningAgent) -> AsyncIterator[aiohttp.ClientSession]:
    """A session whose connections are all new: a new context, so no TLS resumption."""
    context = client_context(running_agent.pki, running_agent.pki.master, running_agent.tmp / "f")
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=context, force_close=True), headers=master_headers()
    )
    yield session
    await session.close()


async def _call(session: aiohttp.ClientSession, method: str, url: str,
                body: Any = None) -> tuple[int, dict[str, Any]]:  # fmt: skip
    headers = {**master_headers(), "MirbadLLM-Operation-Id": uuid.uuid4().hex}
    async with session.request(method, url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def _start(agent: RunningAgent, rid: str) -> dict[str, Any]:
    status, body = await _call(
        agent.session, "POST", agent.url("/agent/v1/pki/rotations"), {"rotationId": rid}
    )
    assert status in (200, 201), body
    return body


async def test_start_returns_the_same_csr_and_refuses_a_second_rotation(
    running_agent: RunningAgent,
) -> None:
    rid = _rid()
    first = await _start(running_agent, rid)
    assert first["stage"] == Stage.KEY_GENERATED and "BEGIN CERTIFICATE REQUEST" in first["csrPem"]
    again = await _start(running_agent, rid)
    assert again["csrPem"] == first["csrPem"]  # a lost answer: the same key, the same CSR
    status, body = await _call(
        running_agent.session, "POST", running_agent.url("/agent/v1/pki/rotations"),
        {"rotationId": _rid()},
    )  # fmt: skip
    assert status == 409 and body["error"]["code"] == "invalid_state"
    assert body["error"]["details"]["activeRotationId"] == rid
    async with running_agent.session.get(running_agent.url("/agent/v1/info")) as resp:
        info = await resp.json()
    assert info["rotation"] == {"rotationId": rid, "stage": Stage.KEY_GENERATED}
    assert "pki.rotation" in info["features"]
    status, body = await _call(
        running_agent.session, "POST", running_agent.url("/agent/v1/pki/rotations"),
        {"rotationId": "../x"},
    )  # fmt: skip
    assert status == 400 and "rotationId" in body["error"]["message"]


async def test_the_steps_are_fenced(running_agent: RunningAgent) -> None:
    async with running_agent.session.post(
        running_agent.url("/agent/v1/pki/rotations"),
        json={"rotationId": _rid()},
        headers={"MirbadLLM-Master": "", "MirbadLLM-Request-Time": ""},
    ) as resp:
        assert resp.status == 400
        assert "MirbadLLM-Master is required" in (await resp.json())["error"]["message"]
    assert running_agent.server.rotations.store.active is None


async def test_install_checks_the_certificate_then_presents_it_to_new_connections(
    running_agent: RunningAgent,
) -> None:
    agent = running_agent
    rid = _rid()
    csr = (await _start(agent, rid))["csrPem"]
    old_pin = agent.server.identity.spki_sha256
    url = agent.url(f"/agent/v1/pki/rotations/{rid}/cert")
    other_key = issue(agent.pki.ca, cn="n1", uris=[node_spiffe_id("n1")], eku=NODE_EKU)
    refused = {
        "another key": other_key.cert.public_bytes(serialization.Encoding.PEM).decode(),
        "another node": _sign(agent.pki, csr, node_id="n2"),
        "another CA": _sign(agent.pki, csr, ca=agent.pki.other_ca),
        "no serverAuth": _sign(agent.pki, csr, eku=[ExtendedKeyUsageOID.CLIENT_AUTH]),
        "not a certificate": "hello",
    }
    for why, pem in refused.items():
        status, body = await _call(agent.session, "PUT", url, {"certPem": pem})
        assert status == 400 and body["error"]["code"] == "invalid_request", (why, body)
    assert await _presented(agent) == old_pin
    # A connection made before the install keeps the old certificate.
    context = client_context(agent.pki, agent.pki.master, agent.tmp / "early")
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.server.port, ssl=context)
    try:
        cert_pem = _sign(agent.pki, csr)
        status, body = await _call(agent.session, "PUT", url, {"certPem": cert_pem})
        assert status == 200 and body["stage"] == Stage.CERT_INSTALLED, body
        pending = body["pendingSpki"]
        assert pending == spki_sha256(x509.load_pem_x509_certificate(cert_pem.encode()))
        assert await _presented(agent) == pending  # new connections: the new certificate
        early = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert spki_sha256(early) == old_pin
        writer.write(b"GET /agent/v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
        # The same certificate again answers as the first time; another one is refused.
        status, body = await _call(agent.session, "PUT", url, {"certPem": cert_pem})
        assert status == 200 and body["stage"] == Stage.CERT_INSTALLED
        status, body = await _call(agent.session, "PUT", url, {"certPem": _sign(agent.pki, csr)})
        assert status == 409 and body["error"]["code"] == "invalid_state"
    finally:
        writer.close()


async def test_commit_only_over_the_pending_certificate_then_promote(
    running_agent: RunningAgent, fresh: aiohttp.ClientSession, state_dir: Path
) -> None:
    agent = running_agent
    rid = _rid()
    # The pooled session's connection is made now, under the old certificate.
    csr = (await _start(agent, rid))["csrPem"]
    cert_pem = _sign(agent.pki, csr)
    status, _ = await _call(
        agent.session,
        "PUT",
        agent.url(f"/agent/v1/pki/rotations/{rid}/cert"),
        {"certPem": cert_pem},
    )
    assert status == 200
    commit = agent.url(f"/agent/v1/pki/rotations/{rid}/commit")
    status, body = await _call(agent.session, "POST", commit)
    assert status == 409 and body["error"]["code"] == "not_on_pending_certificate", body
    assert body["error"]["details"]["presentedSpki"] == agent.server.identity.spki_sha256
    # The proof: a new connection, which reads the rotation and sees the pending pin.
    status, seen = await _call(fresh, "GET", agent.url(f"/agent/v1/pki/rotations/{rid}"))
    assert seen["connection"] == {"presentedSpki": seen["pendingSpki"], "sessionReused": False}
    status, body = await _call(fresh, "POST", commit)
    assert status == 200 and body["stage"] == Stage.COMMITTED, body
    new_pin = seen["pendingSpki"]
    assert agent.server.identity.spki_sha256 == new_pin
    assert load_identity(state_dir, node_id="n1").spki_sha256 == new_pin
    assert not (state_dir / PENDING_KEY_FILE).exists()
    assert not (state_dir / PENDING_CERT_FILE).exists()
    assert await _presented(agent) == new_pin
    async with fresh.get(agent.url("/agent/v1/info")) as resp:
        info = await resp.json()
    assert info["spkiSha256"] == new_pin and info["rotation"] is None
    # A lost commit answer: sent again, it answers the same; an abort now is refused.
    status, body = await _call(fresh, "POST", commit)
    assert status == 200 and body["stage"] == Stage.COMMITTED
    status, body = await _call(fresh, "POST", agent.url(f"/agent/v1/pki/rotations/{rid}/abort"))
    assert status == 409 and body["error"]["code"] == "already_committed"


async def test_abort_before_commit_returns_to_the_old_certificate(
    running_agent: RunningAgent, state_dir: Path
) -> None:
    agent = running_agent
    rid = _rid()
    old_pin = agent.server.identity.spki_sha256
    csr = (await _start(agent, rid))["csrPem"]
    status, _ = await _call(
        agent.session, "PUT", agent.url(f"/agent/v1/pki/rotations/{rid}/cert"),
        {"certPem": _sign(agent.pki, csr)},
    )  # fmt: skip
    assert status == 200 and await _presented(agent) != old_pin
    abort = agent.url(f"/agent/v1/pki/rotations/{rid}/abort")
    status, body = await _call(agent.session, "POST", abort)
    assert status == 200 and body["stage"] == Stage.ABORTED
    assert await _presented(agent) == old_pin
    assert not (state_dir / PENDING_KEY_FILE).exists()
    status, body = await _call(agent.session, "POST", abort)  # again: the same answer
    assert status == 200 and body["stage"] == Stage.ABORTED
    status, body = await _call(
        agent.session, "POST", agent.url(f"/agent/v1/pki/rotations/{rid}/commit")
    )
    assert status == 409 and body["error"]["code"] == "invalid_state"
    await _start(agent, _rid())  # a new rotation may start


# -- recovery after a crash (the store, then the agent started again) -------------------


def _store(state_dir: Path) -> RotationStore:
    return RotationStore(state_dir=state_dir, node_id="n1")


def _installed(pki: Pki, state_dir: Path) -> tuple[RotationStore, str]:
    make_identity(pki, state_dir)
    store = _store(state_dir)
    rid = _rid()
    rotation, _ = store.start(rid)
    store.install(rid, _sign(pki, rotation.csr_pem), ca_cert=pki.ca.cert)
    return store, rid


def test_a_torn_promotion_is_finished(pki: Pki, state_dir: Path) -> None:
    store, rid = _installed(pki, state_dir)
    assert store.active is not None
    pending = store.active.pending_spki
    # The crash: Committed persisted and agent.key replaced, agent.crt not yet.
    store._set_stage(store.active, Stage.COMMITTED)
    (state_dir / "agent.key").write_bytes((state_dir / PENDING_KEY_FILE).read_bytes())
    with pytest.raises(Exception, match="not for this agent's key"):
        load_identity(state_dir, node_id="n1")
    assert "finished the promotion" in (_store(state_dir).recover() or "")
    assert load_identity(state_dir, node_id="n1").spki_sha256 == pending
    assert not (state_dir / PENDING_KEY_FILE).exists()
    assert _store(state_dir).find(rid).stage == Stage.COMMITTED


def test_bootstrap_enroll_recovers_before_it_loads_the_identity(
    pki: Pki, state_dir: Path, make_config: Any
) -> None:
    store, _ = _installed(pki, state_dir)
    assert store.active is not None
    pending = store.active.pending_spki
    store._set_stage(store.active, Stage.COMMITTED)
    (state_dir / "agent.key").write_bytes((state_dir / PENDING_KEY_FILE).read_bytes())
    config: AgentConfig = make_config()
    assert bootstrap_enroll(config).spki_sha256 == pending


def test_pending_material_that_does_not_match_its_stage_is_dropped(
    pki: Pki, state_dir: Path
) -> None:
    make_identity(pki, state_dir)
    # A pending key with no rotation (the crash came before the record).
    (state_dir / PENDING_KEY_FILE).write_bytes(b"key")
    assert _store(state_dir).recover() == "dropped pending files of no rotation"
    assert not (state_dir / PENDING_KEY_FILE).exists()
    # A certificate written while the stage still says KeyGenerated: the master repeats it.
    store = _store(state_dir)
    rid = _rid()
    rotation, _ = store.start(rid)
    (state_dir / PENDING_CERT_FILE).write_text(_sign(pki, rotation.csr_pem))
    assert "dropped an uninstalled certificate" in (_store(state_dir).recover() or "")
    assert not (state_dir / PENDING_CERT_FILE).exists()
    assert _store(state_dir).find(rid).stage == Stage.KEY_GENERATED
    # The pending key lost: the rotation cannot go on, it is aborted (the master follows).
    (state_dir / PENDING_KEY_FILE).unlink()
    assert "pending key is missing" in (_store(state_dir).recover() or "")
    assert _store(state_dir).find(rid).stage == Stage.ABORTED
    assert json.loads((state_dir / ROTATION_FILE).read_text())["active"] is None


async def test_a_restarted_agent_presents_its_installed_certificate_again(
    pki: Pki, state_dir: Path, tmp_path: Path, make_config: Any
) -> None:
    store, rid = _installed(pki, state_dir)
    assert store.active is not None
    pending = store.active.pending_spki
    config: AgentConfig = make_config()
    server = AgentServer(config=config, identity=bootstrap_enroll(config))
    await server.start()
    try:
        context = client_context(pki, pki.master, tmp_path / "c")
        _, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context)
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        assert spki_sha256(der) == pending
        assert server.rotations.summary() == {"rotationId": rid, "stage": Stage.CERT_INSTALLED}
    finally:
        await server.stop()


def _raw_request(
    port: int, ctx: ssl.SSLContext, request: bytes, session: ssl.SSLSession | None = None
) -> tuple[bytes, ssl.SSLSession | None, bool]:
    """One request on a new connection (offering ``session``): the answer, the
    session the agent left, and whether the handshake resumed."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, session=session) as tls,
    ):
        tls.sendall(request)
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
        return data, tls.session, tls.session_reused


def _commit_request(rid: str) -> bytes:
    headers = {**master_headers(), "MirbadLLM-Operation-Id": uuid.uuid4().hex,
               "Host": "agent", "Content-Length": "0", "Connection": "close"}  # fmt: skip
    lines = [f"POST /agent/v1/pki/rotations/{rid}/commit HTTP/1.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_a_resumed_session_never_commits(
    running_agent: RunningAgent, state_dir: Path
) -> None:
    """TLS 1.3: the agent issues no session tickets, so nothing resumes. TLS 1.2: a
    session-id resumption skips the certificate, and the commit refuses it."""
    agent = running_agent
    rid = _rid()
    csr = (await _start(agent, rid))["csrPem"]
    status, _ = await _call(agent.session, "PUT", agent.url(f"/agent/v1/pki/rotations/{rid}/cert"),
                            {"certPem": _sign(agent.pki, csr)})  # fmt: skip
    assert status == 200
    port = agent.server.port
    tls13 = client_context(agent.pki, agent.pki.master, agent.tmp / "t13")
    _, session, _ = await asyncio.to_thread(_raw_request, port, tls13, b"GET / HTTP/1.0\r\n\r\n")
    assert session is not None and not session.has_ticket
    _, _, resumed = await asyncio.to_thread(_raw_request, port, tls13, b"x", session)
    assert not resumed

    tls12 = client_context(agent.pki, agent.pki.master, agent.tmp / "t12")
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    _, session, _ = await asyncio.to_thread(_raw_request, port, tls12, b"GET / HTTP/1.0\r\n\r\n")
    answer, _, resumed = await asyncio.to_thread(
        _raw_request, port, tls12, _commit_request(rid), session
    )
    assert resumed, "OpenSSL kept no TLS 1.2 session: the refusal went untested"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 409"), answer
    error = json.loads(body)["error"]
    assert error["code"] == "not_on_pending_certificate" and error["details"]["sessionReused"]
    status, body = await _call(agent.session, "GET", agent.url(f"/agent/v1/pki/rotations/{rid}"))
    assert body["stage"] == Stage.CERT_INSTALLED, body
