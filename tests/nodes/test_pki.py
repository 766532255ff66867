"""The CA, node certificates and the identity checks the master applies to agents."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nodes import pki
from protocol.identity import MASTER_SPIFFE_ID


def _csr(node_id: str) -> tuple[ec.EllipticCurvePrivateKey, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM).decode()


def _odd_cert(
    ca: pki.CertificateAuthority,
    *,
    uris: list[str],
    days: int = 90,
    start: dt.datetime | None = None,
    ekus: list[x509.ObjectIdentifier] | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    begin = start or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(begin + dt.timedelta(days=days))
        .add_extension(
            x509.ExtendedKeyUsage(ekus or [ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    )
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            critical=False,
        )
    return key, builder.sign(ca.key, hashes.SHA256())


@pytest.fixture
def ca(tmp_path: Path) -> pki.CertificateAuthority:
    return pki.load_or_create_ca(tmp_path / "pki")


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def test_ca_files_are_private_and_created_once(tmp_path: Path) -> None:
    first = pki.load_or_create_ca(tmp_path / "pki")
    second = pki.load_or_create_ca(tmp_path / "pki")
    assert first.spki_sha256 == second.spki_sha256
    assert stat.S_IMODE((tmp_path / "pki").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "pki" / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "pki" / "ca.crt").stat().st_mode) == 0o600
    assert isinstance(first.key.curve, ec.SECP256R1)


def test_node_certificate_content(ca: pki.CertificateAuthority) -> None:
    _, csr = _csr("box-1")
    cert = pki.issue_node_certificate(ca, csr_pem=csr, node_id="box-1")
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://mirbadllm/node/box-1"
    ]
    assert sans.get_values_for_type(x509.DNSName) == []
    ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(ekus) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=89) < lifetime <= dt.timedelta(days=91)
    pki.verify_node_certificate(
        _der(cert), ca_cert=ca.cert, node_id="box-1", pins=[pki.spki_sha256(cert)]
    )


def test_master_client_certificate(ca: pki.CertificateAuthority) -> None:
    leaf = pki.ensure_master_client_certificate(ca)
    data = leaf.path.read_bytes()
    cert = x509.load_pem_x509_certificate(data)
    key = serialization.load_pem_private_key(data, password=None)  # key and cert, one file
    assert key.public_key() == cert.public_key()
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [MASTER_SPIFFE_ID]
    ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(ekus) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert stat.S_IMODE(leaf.path.stat().st_mode) == 0o600
    # Not at half life yet: the same certificate comes back.
    again = pki.ensure_master_client_certificate(ca)
    assert again.serial == leaf.serial and again.path.read_bytes() == data


def test_master_certificates_are_reissued_at_half_life(
    ca: pki.CertificateAuthority, monkeypatch: pytest.MonkeyPatch
) -> None:
    lifetime = dt.timedelta(seconds=60)
    first = pki.ensure_master_client_certificate(ca, lifetime=lifetime)
    # A short lifetime is not past its half life when it is made (the backdate is a
    # tenth of it), so it is not re-issued at once, again and again.
    assert pki.ensure_master_client_certificate(ca, lifetime=lifetime).serial == first.serial
    assert first.not_after - first.not_before == lifetime
    now = pki._now()
    monkeypatch.setattr(pki, "_now", lambda: now + dt.timedelta(seconds=31))
    second = pki.ensure_master_client_certificate(ca, lifetime=lifetime)
    assert second.serial != first.serial
    assert second.not_after > first.not_after
    enroll = pki.ensure_enroll_certificate(ca, ["127.0.0.1"], lifetime=lifetime)
    assert enroll.path != second.path


def test_racing_reissues_leave_one_matching_key_and_certificate(
    ca: pki.CertificateAuthority,
) -> None:
    """Every master process re-issues at half life: the lock makes one of them do it."""
    leaves: list[pki.LeafCertificate] = []
    barrier = threading.Barrier(8)

    def reissue() -> None:
        barrier.wait()
        leaves.append(pki.ensure_master_client_certificate(ca))

    threads = [threading.Thread(target=reissue) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({leaf.serial for leaf in leaves}) == 1
    data = leaves[0].path.read_bytes()
    key = serialization.load_pem_private_key(data, password=None)
    assert key.public_key() == x509.load_pem_x509_certificate(data).public_key()


def test_the_two_files_of_earlier_releases_are_replaced(ca: pki.CertificateAuthority) -> None:
    folder = ca.cert_path.parent
    (folder / "master-client.crt").write_text("old")
    (folder / "master-client.key").write_text("old")
    leaf = pki.ensure_master_client_certificate(ca)
    assert leaf.path == folder / "master-client.pem"
    assert not (folder / "master-client.crt").exists()
    assert not (folder / "master-client.key").exists()


def test_csr_with_wrong_key_type_is_refused(ca: pki.CertificateAuthority) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n")]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    with pytest.raises(pki.PkiError, match="P-256"):
        pki.issue_node_certificate(ca, csr_pem=csr, node_id="n")
    with pytest.raises(pki.PkiError, match="csrPem"):
        pki.issue_node_certificate(ca, csr_pem="not a csr", node_id="n")


def test_two_uri_sans_refused(ca: pki.CertificateAuthority) -> None:
    _, cert = _odd_cert(ca, uris=["spiffe://mirbadllm/node/a", "spiffe://mirbadllm/node/b"])
    with pytest.raises(pki.PeerRejected, match="2 URI SANs"):
        pki.verify_node_certificate(
            _der(cert), ca_cert=ca.cert, node_id="a", pins=[pki.spki_sha256(cert)]
        )


def test_wrong_san_refused(ca: pki.CertificateAuthority) -> None:
    _, cert = _odd_cert(ca, uris=["spiffe://mirbadllm/node/other"])
    with pytest.raises(pki.PeerRejected, match="is for spiffe://mirbadllm/node/other"):
        pki.verify_node_certificate(
            _der(cert), ca_cert=ca.cert, node_id="a", pins=[pki.spki_sha256(cert)]
        )


def test_wrong_ca_refused(ca: pki.CertificateAuthority, tmp_path: Path) -> None:
    other = pki.load_or_create_ca(tmp_path / "other")
    _, cert = _odd_cert(other, uris=["spiffe://mirbadllm/node/a"])
    with pytest.raises(pki.PeerRejected, match="not issued by this CA"):
        pki.verify_node_certificate(
            _der(cert), ca_cert=ca.cert, node_id="a", pins=[pki.spki_sha256(cert)]
        )


def test_expired_refused(ca: pki.CertificateAuthority) -> None:
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=100)
    _, cert = _odd_cert(ca, uris=["spiffe://mirbadllm/node/a"], start=start, days=90)
    with pytest.raises(pki.PeerRejected, match="not valid now"):
        pki.verify_node_certificate(
            _der(cert), ca_cert=ca.cert, node_id="a", pins=[pki.spki_sha256(cert)]
        )


def test_wrong_pin_refused(ca: pki.CertificateAuthority) -> None:
    _, cert = _odd_cert(ca, uris=["spiffe://mirbadllm/node/a"])
    _, other = _odd_cert(ca, uris=["spiffe://mirbadllm/node/a"])
    with pytest.raises(pki.PeerRejected, match="does not match the node's pin"):
        pki.verify_node_certificate(
            _der(cert), ca_cert=ca.cert, node_id="a", pins=[pki.spki_sha256(other)]
        )


def test_pending_pin_accepted(ca: pki.CertificateAuthority) -> None:
    _, cert = _odd_cert(ca, uris=["spiffe://mirbadllm/node/a"])
    pki.verify_node_certificate(
        _der(cert), ca_cert=ca.cert, node_id="a", pins=["current-pin", pki.spki_sha256(cert)]
    )


def test_missing_server_auth_refused(ca: pki.CertificateAuthority) -> None:
    _, cert = _odd_cert(
        ca, uris=["spiffe://mirbadllm/node/a"], ekus=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    with pytest.raises(pki.PeerRejected, match="serverAuth"):
        pki.verify_node_certificate(
            _der(cert), ca_cert=ca.cert, node_id="a", pins=[pki.spki_sha256(cert)]
        )


def _serve_once(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, tmp: Path) -> int:
    """A one-shot TLS server presenting ``cert``; returns its port."""
    cert_file, key_file = tmp / "srv.crt", tmp / "srv.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert_file), str(key_file))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"hello")
            except (ssl.SSLError, OSError):
                pass

    threading.Thread(target=serve, daemon=True).start()
    return port


def _client_context(ca: pki.CertificateAuthority, node_id: str, pins: list[str]) -> ssl.SSLContext:
    leaf = pki.ensure_master_client_certificate(ca)
    return pki.agent_client_context(
        ca=ca.cert,
        ca_path=ca.cert_path,
        client_chain=leaf.path,
        node_id=node_id,
        pins=pins,
    )


def test_pinned_handshake_accepts_the_right_node(
    ca: pki.CertificateAuthority, tmp_path: Path
) -> None:
    key, cert = _odd_cert(ca, uris=["spiffe://mirbadllm/node/a"])
    port = _serve_once(cert, key, tmp_path)
    context = _client_context(ca, "a", [pki.spki_sha256(cert)])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with context.wrap_socket(raw) as tls:
            assert tls.recv(5) == b"hello"


def test_pinned_handshake_refuses_a_wrong_pin_before_any_byte(
    ca: pki.CertificateAuthority, tmp_path: Path
) -> None:
    key, cert = _odd_cert(ca, uris=["spiffe://mirbadllm/node/a"])
    port = _serve_once(cert, key, tmp_path)
    context = _client_context(ca, "a", ["some-other-pin"])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with pytest.raises(ssl.SSLCertVerificationError, match="does not match the node's pin"):
            context.wrap_socket(raw)
