"""Enrollment against a small aiohttp TLS enroll listener."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import ssl
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agent_support import Issued, Pki, issue
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent import EnrollmentError, TokenRefused, UntrustedEnrollEndpoint, __version__
from agent.__main__ import main
from agent._config import AgentConfig
from agent.identity._enroll import bootstrap_enroll, join
from agent.identity._tls import has_identity, load_identity
from protocol.identity import spki_sha256

pytestmark = pytest.mark.timeout(30)
TOKEN = "join-token-secret-123"


@dataclass
class Listener:
    url: str
    pki: Pki
    requests: list[tuple[str, Any]] = field(default_factory=list)
    mode: str = "ok"

    @property
    def ca_hash(self) -> str:
        return "sha256:" + spki_sha256(self.pki.ca.cert)


def sign_csr(ca: Issued, csr_pem: str, node_id: str) -> str:
    csr = x509.load_pem_x509_csr(csr_pem.encode())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(csr.subject)
        .issuer_name(ca.cert.subject)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=90))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"spiffe://mirbadllm/node/{node_id}")]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


async def start_listener(
    pki: Pki, tmp_path: Path, *, listener_ca: Issued, served_ca: Issued
) -> tuple[Listener, web.AppRunner]:
    listener = Listener(url="", pki=pki)

    async def get_ca(request: web.Request) -> web.Response:
        listener.requests.append(("GET /ca", None))
        return web.json_response({"caCertPem": served_ca.cert_pem.decode()})

    async def post_enroll(request: web.Request) -> web.Response:
        body = await request.json()
        listener.requests.append(("POST /enroll", body))
        if listener.mode == "token_used":
            return web.json_response(
                {"error": {"code": "token_used", "message": "This join token was already used."}},
                status=401,
            )
        if listener.mode == "node_enrolled":
            return web.json_response(
                {"error": {"code": "node_enrolled", "message": "Node n1 already holds a pin."}},
                status=409,
            )
        cert_pem = sign_csr(pki.ca, body["csrPem"], body["nodeId"])
        return web.json_response(
            {
                "nodeId": body["nodeId"],
                "certPem": cert_pem,
                "caCertPem": pki.ca.cert_pem.decode(),
                "approved": True,
            }
        )

    app = web.Application()
    app.router.add_get("/ca", get_ca)
    app.router.add_post("/enroll", post_enroll)
    server_cert = issue(
        listener_ca,
        cn="enroll",
        uris=["spiffe://mirbadllm/master/enroll"],
        eku=[ExtendedKeyUsageOID.SERVER_AUTH],
        dns=["mirbadllm"],
    )
    cert_path, key_path = server_cert.write(tmp_path / "listener", "enroll")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert_path), str(key_path))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    listener.url = f"https://127.0.0.1:{runner.addresses[0][1]}"
    return listener, runner


@pytest.fixture
async def listener(pki: Pki, tmp_path: Path) -> AsyncIterator[Listener]:
    found, runner = await start_listener(pki, tmp_path, listener_ca=pki.ca, served_ca=pki.ca)
    yield found
    await runner.cleanup()


def run_join(listener: Listener, state: Path, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "enroll_url": listener.url,
        "ca_hash": listener.ca_hash,
        "node_id": "n1",
        "state_dir": state,
        "addresses": ["https://10.0.0.5:9443"],
        "token": TOKEN,
        "retry_seconds": 0,
    }
    args.update(kw)
    return asyncio.to_thread(join, **args)


async def test_join_enrolls(listener: Listener, tmp_path: Path) -> None:
    state = tmp_path / "state"
    identity = await run_join(listener, state)
    assert identity.node_id == "n1"
    assert stat.S_IMODE((state / "agent.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert load_identity(state, node_id="n1").spki_sha256 == identity.spki_sha256
    (first, _), (second, body) = listener.requests
    assert (first, second) == ("GET /ca", "POST /enroll")
    assert body["token"] == TOKEN and body["nodeId"] == "n1"
    assert body["addresses"] == ["https://10.0.0.5:9443"]
    assert body["agentVersion"] == __version__ and body["protocolVersions"] == [1]
    assert body["csrPem"].startswith("-----BEGIN CERTIFICATE REQUEST-----")


async def test_join_ca_hash_mismatch_sends_nothing(listener: Listener, tmp_path: Path) -> None:
    wrong = "sha256:" + spki_sha256(listener.pki.other_ca.cert)
    with pytest.raises(UntrustedEnrollEndpoint, match="refusing to send the token"):
        await run_join(listener, tmp_path / "state", ca_hash=wrong)
    assert [r[0] for r in listener.requests] == ["GET /ca"]
    assert not has_identity(tmp_path / "state")


async def test_join_listener_from_another_ca_never_gets_the_token(pki: Pki, tmp_path: Path) -> None:
    """/ca serves the real CA (it is public), but the listener's cert is not from it."""
    fake, runner = await start_listener(pki, tmp_path, listener_ca=pki.other_ca, served_ca=pki.ca)
    try:
        with pytest.raises(UntrustedEnrollEndpoint, match="token was not sent"):
            await run_join(fake, tmp_path / "state")
        assert [r[0] for r in fake.requests] == ["GET /ca"]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("mode", "error", "message"),
    [
        ("token_used", TokenRefused, "This join token was already used."),
        ("node_enrolled", EnrollmentError, "Node n1 already holds a pin."),
    ],
)
async def test_refusals_surface_the_master_message(
    listener: Listener, tmp_path: Path, mode: str, error: type[Exception], message: str
) -> None:
    listener.mode = mode
    with pytest.raises(error) as info:
        await run_join(listener, tmp_path / "state")
    assert message in str(info.value)
    assert getattr(info.value, "code", None) == mode
    assert not has_identity(tmp_path / "state")


async def test_join_keeps_existing_identity_without_force(
    listener: Listener, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    first = await run_join(listener, state)
    with pytest.raises(EnrollmentError, match="--force"):
        await run_join(listener, state)
    second = await run_join(listener, state, force=True)
    assert second.spki_sha256 != first.spki_sha256


async def test_join_cli_reads_token_from_env(
    listener: Listener,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("MIRBAD_JOIN_TOKEN", TOKEN)
    argv = [
        "join", "--enroll-url", listener.url, "--ca-hash", listener.ca_hash,
        "--node-id", "n1", "--state-dir", str(tmp_path / "state"), "--address", "10.0.0.9",
    ]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr()
    assert "Certificate fingerprint (SPKI SHA-256)" in out.out
    assert TOKEN not in out.out + out.err
    assert listener.requests[-1][1]["addresses"] == ["https://10.0.0.9:9443"]


def write_bundle(directory: Path, listener: Listener, **overrides: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    bundle = {
        "nodeId": "n1",
        "token": TOKEN,
        "caCertPem": listener.pki.ca.cert_pem.decode(),
        "caSpkiSha256": spki_sha256(listener.pki.ca.cert),
        "enrollEndpoint": listener.url,
        "createdAt": "2026-12-01T08:00:00.000Z",
        "expiresAt": "2026-12-02T08:00:00.000Z",
    }
    bundle.update(overrides)
    path = directory / "bootstrap.json"
    path.write_text(json.dumps(bundle))
    path.chmod(0o600)
    return path


@pytest.fixture
def boot_config(make_config: Callable[..., AgentConfig], tmp_path: Path) -> AgentConfig:
    return make_config(
        bootstrap_directory=tmp_path / "bootstrap",
        bootstrap_wait_seconds=5,
        addresses=("https://agent:9443",),
    )


async def test_bootstrap_enrolls_and_deletes_bundle(
    listener: Listener, boot_config: AgentConfig
) -> None:
    assert boot_config.bootstrap_directory is not None
    bundle = write_bundle(boot_config.bootstrap_directory, listener)
    identity = await asyncio.to_thread(bootstrap_enroll, boot_config, poll_interval=0.05)
    assert identity.node_id == "n1"
    assert not bundle.exists()
    assert listener.requests[-1][1]["addresses"] == ["https://agent:9443"]
    # With an identity, nothing is contacted again.
    listener.requests.clear()
    again = await asyncio.to_thread(bootstrap_enroll, boot_config)
    assert again.spki_sha256 == identity.spki_sha256 and listener.requests == []


async def test_bootstrap_waits_for_the_bundle(
    listener: Listener, boot_config: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    assert boot_config.bootstrap_directory is not None
    directory = boot_config.bootstrap_directory
    timer = threading.Timer(0.3, write_bundle, args=(directory, listener))
    timer.start()
    with caplog.at_level("INFO", logger="mirbad.agent.enroll"):
        started = time.monotonic()
        await asyncio.to_thread(bootstrap_enroll, boot_config, poll_interval=0.05)
    assert time.monotonic() - started >= 0.25
    assert f"waiting for the master's bootstrap bundle in {directory}" in caplog.text
    assert TOKEN not in caplog.text


async def test_bootstrap_hash_mismatch_refused_before_connecting(
    listener: Listener, boot_config: AgentConfig
) -> None:
    assert boot_config.bootstrap_directory is not None
    write_bundle(
        boot_config.bootstrap_directory,
        listener,
        caSpkiSha256=spki_sha256(listener.pki.other_ca.cert),
    )
    with pytest.raises(UntrustedEnrollEndpoint):
        await asyncio.to_thread(bootstrap_enroll, boot_config, poll_interval=0.05)
    assert listener.requests == []


async def test_bootstrap_gives_up_after_the_wait(
    make_config: Callable[..., AgentConfig], tmp_path: Path
) -> None:
    config = make_config(bootstrap_directory=tmp_path / "none", bootstrap_wait_seconds=0.2)
    with pytest.raises(EnrollmentError, match=r"Not enrolled after 0\.2 s"):
        await asyncio.to_thread(bootstrap_enroll, config, poll_interval=0.05)


async def test_bootstrap_retries_an_unreachable_listener(
    listener: Listener, make_config: Callable[..., AgentConfig], tmp_path: Path
) -> None:
    config = make_config(bootstrap_directory=tmp_path / "b", bootstrap_wait_seconds=0.3)
    write_bundle(tmp_path / "b", listener, enrollEndpoint="https://127.0.0.1:1")
    with pytest.raises(EnrollmentError, match="did not answer"):
        await asyncio.to_thread(bootstrap_enroll, config, poll_interval=0.05)
