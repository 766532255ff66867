"""Identities both sides check: SPIFFE ids in certificates and the SPKI pin.

The master presents a client certificate whose single URI SAN is
:data:`MASTER_SPIFFE_ID`; a node's certificate carries ``spiffe://mirbadllm/node/<id>``.
A pin is the base64 SHA-256 of the DER SubjectPublicKeyInfo (docs/agent-api.md,
"Transport and trust"; docs/decisions.md D4, D5).
"""

from __future__ import annotations

import base64
import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

__all__ = [
    "MASTER_SPIFFE_ID",
    "NODE_SPIFFE_PREFIX",
    "key_spki_sha256",
    "load_certificate",
    "node_spiffe_id",
    "spki_sha256",
    "uri_sans",
]

MASTER_SPIFFE_ID = "spiffe://mirbadllm/master"
NODE_SPIFFE_PREFIX = "spiffe://mirbadllm/node/"


def node_spiffe_id(node_id: str) -> str:
    """The URI SAN a node certificate carries."""
    return NODE_SPIFFE_PREFIX + node_id


def load_certificate(data: bytes) -> x509.Certificate:
    """A certificate from PEM or DER bytes."""
    if data.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(data)
    return x509.load_der_x509_certificate(data)


def spki_sha256(cert: x509.Certificate | bytes) -> str:
    """Base64 (standard) of SHA-256 over the DER SubjectPublicKeyInfo: the pin format."""
    if isinstance(cert, bytes):
        cert = load_certificate(cert)
    return key_spki_sha256(cert.public_key())


def key_spki_sha256(key: CertificatePublicKeyTypes) -> str:
    """The pin of a public key (the SPKI of any certificate for it)."""
    spki = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(spki).digest()).decode("ascii")


def uri_sans(cert: x509.Certificate) -> list[str]:
    """The certificate's URI subject alternative names (empty without the extension)."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(ext.value.get_values_for_type(x509.UniformResourceIdentifier))
