"""Node identity: CSR, storage, SPKI pin, master certificate checks, node id check."""

from __future__ import annotations

import base64
import hashlib
import stat
from pathlib import Path

import pytest
from agent_support import MASTER_URI, Pki, issue, make_identity
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent import ClientNotMaster, IdentityError
from agent.identity._tls import (
    check_master_client_cert,
    generate_key_and_csr,
    has_identity,
    load_identity,
    node_id_from_cert,
    spki_sha256,
)


def der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def test_csr_carries_node_id() -> None:
    key, csr_pem = generate_key_and_csr("n7")
    csr = x509.load_pem_x509_csr(csr_pem)
    assert csr.is_signature_valid
    assert csr.subject.rfc4514_string() == "CN=n7"
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://mirbadllm/node/n7"]
    assert key.curve.name == "secp256r1"


def test_store_and_load(pki: Pki, tmp_path: Path) -> None:
    state = tmp_path / "s"
    identity = make_identity(pki, state, "n1")
    assert has_identity(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "agent.key").stat().st_mode) == 0o600
    assert identity.node_id == "n1"
    assert node_id_from_cert(identity.cert) == "n1"


def test_node_id_mismatch_message(pki: Pki, tmp_path: Path) -> None:
    make_identity(pki, tmp_path / "s", "n1")
    with pytest.raises(IdentityError) as info:
        load_identity(tmp_path / "s", node_id="other")
    assert str(info.value) == "The agent certificate is for node 'n1', but the config says 'other'."


def test_missing_identity_says_how_to_enroll(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="enroll first"):
        load_identity(tmp_path, node_id="n1")


def test_spki_sha256_is_base64_of_der_spki(pki: Pki) -> None:
    spki = pki.ca.cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    expected = base64.b64encode(hashlib.sha256(spki).digest()).decode()
    assert spki_sha256(pki.ca.cert) == expected
    assert spki_sha256(pki.ca.cert_pem) == expected
    assert spki_sha256(der(pki.ca.cert)) == expected


def test_master_cert_accepted(pki: Pki) -> None:
    check_master_client_cert(der(pki.master.cert))


@pytest.mark.parametrize(
    ("uris", "eku", "needle"),
    [
        (["spiffe://mirbadllm/node/n1"], [ExtendedKeyUsageOID.CLIENT_AUTH], "not the master"),
        ([MASTER_URI], [ExtendedKeyUsageOID.SERVER_AUTH], "clientAuth"),
        ([MASTER_URI], [], "no extended key usage"),
        ([MASTER_URI, "spiffe://mirbadllm/other"], [ExtendedKeyUsageOID.CLIENT_AUTH], "2 URI"),
        ([], [ExtendedKeyUsageOID.CLIENT_AUTH], "0 URI"),
    ],
)
def test_non_master_certs_refused(
    pki: Pki, uris: list[str], eku: list[x509.ObjectIdentifier], needle: str
) -> None:
    cert = issue(pki.ca, cn="x", uris=uris, eku=eku).cert
    with pytest.raises(ClientNotMaster, match=needle):
        check_master_client_cert(der(cert))


def test_no_client_cert_refused() -> None:
    with pytest.raises(ClientNotMaster, match="no client certificate"):
        check_master_client_cert(None)
