"""Refused TLS handshakes are not silent: the client gets an alert, the agent a log line.

The agent runs on uvloop (D27), whose TLS protocol is not asyncio's, so the real
listener is tried on both loops. The log is limited to one line a second per peer,
checked with a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from agent_support import Pki, client_context, make_identity

from agent._config import AgentConfig
from agent.http._refusals import RefusalLog, peer_address
from agent.http._server import AgentServer
from agent.identity._tls import handshake_refusal, server_ssl_context

pytestmark = pytest.mark.timeout(60)

LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]
LOGGER = "mirbad.agent.server"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the rate limit ---------------------------------------------------------------------


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_twenty_refusals_in_a_second_from_one_peer_make_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    refusals = RefusalLog(logging.getLogger("test.refusals"), clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        written = []
        for i in range(20):
            # Every connection comes from its own port: the limit is per address.
            written.append(refusals.refused(("10.0.0.7", 40000 + i), "Refused", "bad ca"))
            clock.now += 0.04  # 20 in 0.8 s
        assert written == [True] + [False] * 19
        assert _lines(caplog) == ["Refused from 10.0.0.7:40000: bad ca"]
        clock.now = 1001.0  # a second after the first line
        assert refusals.refused(("10.0.0.7", 41000), "Refused", "bad ca")
    assert _lines(caplog)[1] == (
        "Refused from 10.0.0.7:41000: bad ca (19 more from this address since its last line)"
    )


def test_each_peer_has_its_own_second(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    refusals = RefusalLog(logging.getLogger("test.refusals"), clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        assert refusals.refused(("10.0.0.1", 1), "Refused", "x")
        assert refusals.refused(("10.0.0.2", 1), "Refused", "x")
        assert refusals.refused(("::1", 5, 0, 0), "Refused", "x")
        assert not refusals.refused(("10.0.0.1", 2), "Refused", "x")
    assert _lines(caplog)[2] == "Refused from [::1]:5: x"


def test_memory_is_bounded_under_a_flood_of_addresses() -> None:
    clock = FakeClock()
    refusals = RefusalLog(logging.getLogger("test.refusals"), clock=clock, max_peers=100)
    for i in range(1000):
        refusals.refused((f"10.1.{i // 256}.{i % 256}", 1), "Refused", "x")
    assert len(refusals) == 100
    clock.now += 1.0
    refusals.refused(("10.9.9.9", 1), "Refused", "x")
    assert len(refusals) == 1  # the quiet ones are forgotten once their second is over


def test_peer_address_without_a_peername() -> None:
    assert peer_address(None) == ("", "an unknown address")


def test_handshake_refusal_reads_the_reason() -> None:
    assert handshake_refusal(None) is None
    assert handshake_refusal(object()) is None

    class Refused:
        handshake_error = ssl.SSLCertVerificationError(1, "certificate verify failed")

    Refused.handshake_error.reason = "CERTIFICATE_VERIFY_FAILED"
    Refused.handshake_error.verify_message = "unable to get local issuer certificate"
    assert handshake_refusal(Refused()) == (
        "certificate verify failed: unable to get local issuer certificate"
    )


def test_a_refused_connection_passes_nothing(pki: Pki, state_dir: Path, tmp_path: Path) -> None:
    """Recorded instead of raised, the failure must still let no byte through."""
    server_ctx = server_ssl_context(make_identity(pki, state_dir))
    client_ctx = client_context(pki, pki.other_master, tmp_path / "o")
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out)
    for _ in range(5):  # a memory-BIO handshake, flight by flight
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    assert handshake_refusal(server) == (
        "certificate verify failed: unable to get local issuer certificate"
    )
    with pytest.raises(ssl.SSLError, match="ALERT_UNKNOWN_CA"):
        client.read(100)  # the alert was written for the client to read
    s_in.write(b"\x17\x03\x03\x00\x05hello")  # a record of "application data"
    with pytest.raises(ssl.SSLWantReadError):
        server.read(100)
    with pytest.raises(ssl.SSLError):
        server.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert server.getpeercert() is None and server.getpeercert(binary_form=True) is None
    assert server.unwrap() is None


# -- the real listener --------------------------------------------------------------------


def _tls_exchange(port: int, ctx: ssl.SSLContext, request: bytes | None) -> bytes | Exception:
    """Handshake, optionally send ``request``, read to the end: what the client got."""
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            ctx.wrap_socket(raw) as tls,
        ):
            if request is not None:
                tls.sendall(request)
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
            return data
    except (ssl.SSLError, OSError) as exc:
        return exc


def _client(pki: Pki, who: Any, folder: Path, *, tls12: bool = False) -> ssl.SSLContext:
    ctx = client_context(pki, who, folder)
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _on_agent(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    config: AgentConfig,
    pki: Pki,
    state_dir: Path,
    work: Callable[[AgentServer], Any],
) -> Any:
    """Run ``work(server)`` in a thread while an AgentServer serves on ``loop_factory``."""

    async def main() -> Any:
        server = AgentServer(
            config=config,
            identity=make_identity(pki, state_dir),
            ready_poll_interval=0.1,
            stop_grace_seconds=2.0,
        )
        await server.start()
        try:
            return await asyncio.to_thread(work, server)
        finally:
            await server.stop()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


INFO = b"GET /agent/v1/info HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize("loop_factory", LOOPS, ids=["asyncio", "uvloop"])
def test_certificate_from_another_ca_gets_an_alert_and_one_warning(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    make_config: Callable[..., AgentConfig],
    pki: Pki,
    state_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    foreign13 = _client(pki, pki.other_master, tmp_path / "o13")
    foreign12 = _client(pki, pki.other_master, tmp_path / "o12", tls12=True)
    master = _client(pki, pki.master, tmp_path / "m")

    def work(server: AgentServer) -> dict[str, Any]:
        assert server.port is not None
        port = server.port
        # TLS 1.3: the client's handshake ends before the agent checks its certificate,
        # so the alert is what its first read gets. TLS 1.2: the handshake itself fails.
        clock = FakeClock()
        server.refusals.clock = clock
        first = _tls_exchange(port, foreign13, None)
        clock.now += 2.0  # the rate limit is tested below; here each one is logged
        second = _tls_exchange(port, foreign12, INFO)
        return {"tls13": first, "tls12": second, "master": _tls_exchange(port, master, INFO)}

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        seen = _on_agent(loop_factory, make_config(), pki, state_dir, work)
    for version in ("tls13", "tls12"):
        got = seen[version]
        # Before the fix: SSLEOFError / an empty read, i.e. no alert at all.
        assert isinstance(got, ssl.SSLError), f"{version}: {got!r}"
        assert got.reason == "TLSV1_ALERT_UNKNOWN_CA", f"{version}: {got!r}"
    assert seen["master"].startswith(b"HTTP/1.1 200"), seen["master"][:200]
    lines = [m for m in _lines(caplog) if m.startswith("Refused a TLS handshake")]
    assert len(lines) == 2, lines  # one line per refused handshake
    assert lines[0].startswith("Refused a TLS handshake from 127.0.0.1:")
    assert "certificate verify failed: unable to get local issuer certificate" in lines[0]


@pytest.mark.parametrize("loop_factory", LOOPS, ids=["asyncio", "uvloop"])
def test_no_client_certificate_gets_an_alert_too(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    make_config: Callable[..., AgentConfig],
    pki: Pki,
    state_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    anonymous = _client(pki, None, tmp_path / "none")

    def work(server: AgentServer) -> Any:
        assert server.port is not None
        return _tls_exchange(server.port, anonymous, None)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = _on_agent(loop_factory, make_config(), pki, state_dir, work)
    assert isinstance(got, ssl.SSLError) and "ALERT_CERTIFICATE_REQUIRED" in str(got.reason)
    assert any("Refused a TLS handshake from 127.0.0.1:" in m for m in _lines(caplog))


def test_twenty_refused_handshakes_from_one_peer_log_one_line(
    make_config: Callable[..., AgentConfig],
    pki: Pki,
    state_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    foreign = _client(pki, pki.other_master, tmp_path / "o")

    def work(server: AgentServer) -> list[Any]:
        assert server.port is not None
        # Frozen: the 20 handshakes count as one second however slow the machine is.
        server.refusals.clock = lambda: 0.0
        return [_tls_exchange(server.port, foreign, INFO) for _ in range(20)]

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        results = _on_agent(uvloop.new_event_loop, make_config(), pki, state_dir, work)
    assert all(isinstance(r, ssl.SSLError) for r in results), results
    lines = [m for m in _lines(caplog) if m.startswith("Refused a TLS handshake")]
    assert len(lines) == 1, lines
