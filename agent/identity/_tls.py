"""The node's TLS identity: key, CSR, stored certificates and the listener's SSL context.

The private key is generated here and never leaves the node; the master only ever sees
the CSR. The listener trusts exactly the CA in ``ca.crt`` and, on top of the chain
check that OpenSSL does in the handshake, :func:`check_master_client_cert` makes sure
the client is the master and not, say, another node holding a certificate from the
same CA. A handshake the listener refuses still sends its TLS alert
(:class:`_AlertingSSLObject`).
"""

from __future__ import annotations

import contextlib
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent._errors import ClientNotMaster, IdentityError
from protocol.atomic import fsync_directory, write_atomic
from protocol.identity import (
    MASTER_SPIFFE_ID,
    NODE_SPIFFE_PREFIX,
    node_spiffe_id,
    spki_sha256,
    uri_sans,
)

__all__ = [
    "CA_FILE",
    "CERT_FILE",
    "KEY_FILE",
    "Identity",
    "ServerContext",
    "check_master_client_cert",
    "ensure_state_directory",
    "generate_key_and_csr",
    "handshake_refusal",
    "has_identity",
    "load_identity",
    "node_id_from_cert",
    "presented_spki",
    "server_ssl_context",
    "store_identity",
    "validate_issued_cert",
]

_NODE_PREFIX = NODE_SPIFFE_PREFIX
KEY_FILE = "agent.key"
CERT_FILE = "agent.crt"
CA_FILE = "ca.crt"


@dataclass(frozen=True, kw_only=True)
class Identity:
    """The loaded identity of this agent."""

    node_id: str
    cert: x509.Certificate
    ca_cert: x509.Certificate
    key_path: Path
    cert_path: Path
    ca_path: Path

    @property
    def spki_sha256(self) -> str:
        return spki_sha256(self.cert)


def ensure_state_directory(state_dir: Path) -> None:
    """Create the state directory (0700): it holds the private key and instance keys."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir, 0o700)


def node_id_from_cert(cert: x509.Certificate) -> str:
    """The node id in a node certificate's single ``spiffe://mirbadllm/node/...`` URI SAN."""
    uris = uri_sans(cert)
    if len(uris) != 1 or not uris[0].startswith(_NODE_PREFIX):
        raise IdentityError(
            f"The agent certificate must carry exactly one URI SAN {_NODE_PREFIX}<nodeId>; "
            f"it has {uris or 'none'}."
        )
    return uris[0][len(_NODE_PREFIX) :]


def generate_key_and_csr(node_id: str) -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    """A fresh P-256 key and a PEM CSR for ``node_id`` (CN and SPIFFE URI SAN)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(node_spiffe_id(node_id))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM)


def validate_issued_cert(
    *,
    cert: x509.Certificate,
    ca_cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey | None,
    node_id: str,
) -> None:
    """Refuse a certificate that is not for this key and node, or not signed by the CA.

    Checked before anything is stored, so a confused or hostile answer can never
    replace a working identity with an unusable one.
    """
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"The certificate is not issued by the CA: {exc}") from None
    except InvalidSignature:
        raise IdentityError(
            "The certificate's signature does not verify with the CA key."
        ) from None
    if key is not None:
        ours = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        theirs = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if ours != theirs:
            raise IdentityError("The certificate is not for this agent's key.")
    cert_node = node_id_from_cert(cert)
    if cert_node != node_id:
        raise IdentityError(
            f"The agent certificate is for node '{cert_node}', but the config says '{node_id}'."
        )


def store_identity(
    state_dir: Path, *, key: ec.EllipticCurvePrivateKey, cert_pem: bytes, ca_pem: bytes
) -> None:
    """Write agent.key (0600), ca.crt and agent.crt atomically, the certificate last.

    The certificate is written last because its presence is what :func:`has_identity`
    looks at, so a crash half way leaves an agent that simply enrolls again.
    """
    ensure_state_directory(state_dir)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_dir / CERT_FILE)
    fsync_directory(state_dir)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_atomic(state_dir / KEY_FILE, key_pem, mode=0o600)
    write_atomic(state_dir / CA_FILE, ca_pem, mode=0o644)
    write_atomic(state_dir / CERT_FILE, cert_pem, mode=0o644)


def has_identity(state_dir: Path) -> bool:
    """Whether all three identity files exist."""
    return all((state_dir / name).is_file() for name in (KEY_FILE, CERT_FILE, CA_FILE))


def load_identity(state_dir: Path, *, node_id: str) -> Identity:
    """Load and cross-check the stored identity against the configured node id."""
    paths = {name: state_dir / name for name in (KEY_FILE, CERT_FILE, CA_FILE)}
    missing = [name for name, p in paths.items() if not p.is_file()]
    if missing:
        raise IdentityError(
            f"The state directory {state_dir} has no {', '.join(missing)}; enroll first "
            "(python -m agent join ..., or set BootstrapDirectory)."
        )
    try:
        cert = x509.load_pem_x509_certificate(paths[CERT_FILE].read_bytes())
        ca_cert = x509.load_pem_x509_certificate(paths[CA_FILE].read_bytes())
        key = serialization.load_pem_private_key(paths[KEY_FILE].read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise IdentityError(f"Cannot read the identity in {state_dir}: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IdentityError(f"{paths[KEY_FILE]} is not an EC private key.")
    cert_node = node_id_from_cert(cert)
    if cert_node != node_id:
        raise IdentityError(
            f"The agent certificate is for node '{cert_node}', but the config says '{node_id}'."
        )
    validate_issued_cert(cert=cert, ca_cert=ca_cert, key=key, node_id=node_id)
    return Identity(
        node_id=node_id,
        cert=cert,
        ca_cert=ca_cert,
        key_path=paths[KEY_FILE],
        cert_path=paths[CERT_FILE],
        ca_path=paths[CA_FILE],
    )


class _AlertingSSLObject(ssl.SSLObject):
    """A listener connection whose failed handshake still sends its TLS alert.

    asyncio's and uvloop's TLS protocols close the socket the moment ``do_handshake``
    raises, dropping the alert OpenSSL has just written for the peer: a client with a
    certificate from another CA saw a bare EOF, and nothing was logged. So a failed
    server-side handshake is recorded here instead of raised. The loop then hands the
    connection to the listener's protocol, which sees :func:`handshake_refusal`, logs
    the peer and closes; the close flushes the alert and skips close_notify.

    Nothing can pass in between: OpenSSL refuses to read or write application data on
    a connection whose handshake failed, ``read`` turns that refusal into "no data yet"
    (so that the close still flushes the alert instead of failing first), and no peer
    certificate is reported. Only the methods the loops call once per connection are
    overridden, and ``read`` with no extra call, so a served request costs nothing more.
    """

    handshake_error: ssl.SSLError | None = None
    # The pin of the certificate this connection presents (the context's when the
    # connection began: OpenSSL copies it then), for the rotation's commit check.
    presented_spki: str | None = None
    # ssl.SSLObject's C-level _ssl._SSLSocket, set by its constructor; typeshed leaves
    # it undeclared (a private attribute), and read below calls it directly.
    _sslobj: Any

    # SSLContext.wrap_bio makes every connection's object through this (ssl.py's own
    # factory, since 3.7; asyncio's and uvloop's TLS protocols call wrap_bio).
    @classmethod
    def _create(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super()._create(*args, **kwargs)  # type: ignore[misc]  # private in typeshed
        context = kwargs.get("context")
        obj.presented_spki = context.presented_spki if isinstance(context, ServerContext) else None
        return obj

    def do_handshake(self) -> None:
        if self.handshake_error is not None:
            return  # refused already; OpenSSL would only add a vaguer error
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            if not self.server_side:
                raise
            self.handshake_error = exc

    # ssl.SSLObject.read's own body (it calls the C object directly), so that the
    # override adds no Python frame on the hot path: measured, a super() call cost
    # 0.8-1 us of CPU per read, this version nothing measurable.
    def read(self, len: int = 1024, buffer: Any = None) -> Any:
        if self.handshake_error is not None:
            raise ssl.SSLWantReadError("the TLS handshake was refused")
        if buffer is not None:
            return self._sslobj.read(len, buffer)
        return self._sslobj.read(len)

    def getpeercert(self, binary_form: bool = False) -> Any:
        if self.handshake_error is not None:
            return None  # OpenSSL would raise "handshake not done yet"
        return super().getpeercert(binary_form)

    def unwrap(self) -> Any:
        # After a fatal alert there is no TLS session to close: the close only has to
        # flush the alert, which the loop does once this returns.
        if self.handshake_error is not None:
            return None
        return super().unwrap()


def handshake_refusal(ssl_object: object) -> str | None:
    """Why the listener refused this connection's TLS handshake, or None if it did not.

    ``ssl_object`` is the transport's ``ssl_object`` extra; a connection that has one
    and is not refused here still needs :func:`check_master_client_cert`.
    """
    error = getattr(ssl_object, "handshake_error", None)
    if error is None:
        return None
    # "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: ... (_ssl.c:1006)"
    # says OpenSSL's source line too; the reason and the verify message are the news.
    reason = (getattr(error, "reason", None) or "").lower().replace("_", " ") or str(error)
    verify_message = getattr(error, "verify_message", None)
    return f"{reason}: {verify_message}" if verify_message else reason


class ServerContext(ssl.SSLContext):
    """The listener's context, which knows the pin of the certificate it presents."""

    presented_spki: str | None = None

    def present(self, *, cert_path: Path, key_path: Path, spki: str) -> None:
        """Present this certificate to new connections; open ones keep theirs.

        OpenSSL copies a context's certificate into each connection when it starts, so
        loading another here changes only the handshakes that follow. Called from the
        listener's loop, where the connections' TLS objects are made.
        """
        self.load_cert_chain(str(cert_path), str(key_path))
        self.presented_spki = spki


def server_ssl_context(identity: Identity) -> ServerContext:
    """The listener's context: our cert, client certificates required, CA from ca.crt.

    A client certificate that does not chain to the CA fails the handshake with an
    alert (``unknown ca``; ``certificate required`` when none is sent), which the
    listener logs and then closes (:class:`_AlertingSSLObject`).
    """
    ctx = ServerContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # No session tickets and no resumption (docs/decisions.md D57): a resumed session
    # skips the certificate, so after a rotation it would still speak for the old key,
    # and the rotation's proof needs every connection to show what it negotiated.
    ctx.num_tickets = 0
    ctx.options |= ssl.OP_NO_TICKET
    ctx.present(cert_path=identity.cert_path, key_path=identity.key_path, spki=identity.spki_sha256)
    ctx.load_verify_locations(cafile=str(identity.ca_path))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.sslobject_class = _AlertingSSLObject
    return ctx


def presented_spki(ssl_object: object) -> str | None:
    """The pin of the certificate a listener connection presented (None if unknown)."""
    return getattr(ssl_object, "presented_spki", None)


def check_master_client_cert(der: bytes | None) -> None:
    """Raise ClientNotMaster unless the client certificate is the master's.

    The handshake already proved the chain to our CA; this adds the role check: EKU
    clientAuth and exactly one URI SAN equal to the master's SPIFFE id.
    """
    if not der:
        raise ClientNotMaster("no client certificate was presented")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise ClientNotMaster(f"the client certificate cannot be parsed: {exc}") from None
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise ClientNotMaster("the client certificate has no extended key usage") from None
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        raise ClientNotMaster("the client certificate lacks EKU clientAuth")
    uris = uri_sans(cert)
    if len(uris) != 1:
        raise ClientNotMaster(
            f"the client certificate has {len(uris)} URI SANs; the master's has exactly one"
        )
    if uris[0] != MASTER_SPIFFE_ID:
        raise ClientNotMaster(
            f"the client certificate is {uris[0]!r}, not the master ({MASTER_SPIFFE_ID})"
        )
