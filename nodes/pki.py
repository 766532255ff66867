"""The master's internal CA and the identity checks built on it.

One ECDSA P-256 CA, kept in the shared database by ``nodes/master_store.py`` (D80;
``DATA_PATH/pki`` holds this host's 0600 copies for ``ssl``).
It signs node certificates from CSRs (the node's key never leaves the node),
the master's client certificate for dialing agents and the enroll listener's
server certificate. Identity is the URI SAN (``spiffe://mirbadllm/...``) plus,
for nodes, the pinned SHA-256 of the certificate's SubjectPublicKeyInfo;
hostnames play no part, so a node may move addresses without re-enrolling.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import ipaddress
import os
import secrets
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protocol.atomic import write_atomic
from protocol.identity import MASTER_SPIFFE_ID, node_spiffe_id, spki_sha256, uri_sans

# The defaults; the running values come from MIRBAD_NODE_CERT_SECONDS and
# MIRBAD_MASTER_CERT_SECONDS (core/config.py).
NODE_CERT_LIFETIME = dt.timedelta(days=90)
MASTER_CERT_LIFETIME = dt.timedelta(days=30)
CA_YEARS = 10


class PkiError(Exception):
    """The PKI material is missing, malformed or was refused."""


class PeerRejected(PkiError):
    """A peer certificate failed an identity check; the message says which."""


@dataclass(frozen=True, kw_only=True)
class CertificateAuthority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path

    @property
    def cert_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    @property
    def spki_sha256(self) -> str:
        return spki_sha256(self.cert)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def fingerprint(cert: x509.Certificate) -> str:
    """The key fingerprint an operator compares: ``SHA256:`` + the pin."""
    return "SHA256:" + spki_sha256(cert)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """The key as unencrypted PKCS#8 PEM (the master store seals it before it is kept)."""
    return _key_pem(key)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _ensure_private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)


def new_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A fresh self-signed CA certificate and its key (CA_YEARS of validity)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "MirbadLLM internal CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365 * CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def load_or_create_ca(pki_dir: Path) -> CertificateAuthority:
    """Load the CA of a folder, creating it there first (exactly once, even with racing
    processes).

    The master keeps its CA in the database (``nodes/master_store.py``, D80); a folder
    like this is what earlier releases left in ``DATA_PATH/pki``, imported from there
    once, and what tests build CAs with.
    """
    _ensure_private_dir(pki_dir)
    cert_path, key_path = pki_dir / "ca.crt", pki_dir / "ca.key"
    if not cert_path.exists():
        cert, key = new_ca()
        # The key goes first: a cert without its key must never be left behind.
        try:
            write_atomic(key_path, _key_pem(key), mode=0o600, exclusive=True, parents=True)
            write_atomic(
                cert_path,
                cert.public_bytes(serialization.Encoding.PEM),
                exclusive=True,
                parents=True,
            )
        except FileExistsError:
            pass  # another process won the race; load its CA below
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        # Not `key`: that name holds the generated EC key above, this may be any type.
        loaded = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise PkiError(f"The CA in {pki_dir} cannot be read: {exc}") from exc
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{key_path} is not an EC private key.")
    return CertificateAuthority(cert=cert, key=loaded, cert_path=cert_path)


def _ku_signing() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=True,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _issue(
    ca: CertificateAuthority,
    *,
    public_key: ec.EllipticCurvePublicKey,
    common_name: str,
    sans: list[x509.GeneralName],
    ekus: list[x509.ObjectIdentifier],
    lifetime: dt.timedelta,
) -> x509.Certificate:
    now = _now()
    # Backdated for clocks a little behind ours; by at most a tenth of the lifetime, so
    # a short one (a test's) is not past its half life, and re-issued, when it is made.
    backdate = min(dt.timedelta(minutes=5), lifetime / 10)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - backdate)
        .not_valid_after(now + lifetime - backdate)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_ku_signing(), critical=True)
        .add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
        .sign(ca.key, hashes.SHA256())
    )


def issue_node_certificate(
    ca: CertificateAuthority,
    *,
    csr_pem: str,
    node_id: str,
    lifetime: dt.timedelta = NODE_CERT_LIFETIME,
) -> x509.Certificate:
    """Sign a node's CSR. The content is the master's choice, not the CSR's."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except ValueError as exc:
        raise PkiError(f"csrPem is not a PEM certificate request: {exc}") from None
    if not csr.is_signature_valid:
        raise PkiError("csrPem: the request's signature does not verify.")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise PkiError("csrPem: the node key must be ECDSA P-256.")
    return _issue(
        ca,
        public_key=key,
        common_name=node_id,
        sans=[x509.UniformResourceIdentifier(node_spiffe_id(node_id))],
        ekus=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        lifetime=lifetime,
    )


def _general_names(addresses: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for address in addresses:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            names.append(x509.DNSName(address))
    return names


@dataclass(frozen=True, kw_only=True)
class LeafCertificate:
    """One of the master's own certificates: its key and certificate in one PEM file
    (``load_cert_chain(path)`` reads both), replaced whole at half life."""

    path: Path
    serial: int
    not_before: dt.datetime
    not_after: dt.datetime

    @property
    def half_life(self) -> dt.datetime:
        return self.not_before + (self.not_after - self.not_before) / 2


def _read_leaf(path: Path) -> LeafCertificate | None:
    """The leaf in ``path``, or None when it is missing, unreadable or has no key."""
    try:
        data = path.read_bytes()
        cert = x509.load_pem_x509_certificate(data)
        key = serialization.load_pem_private_key(data, password=None)
    except (OSError, ValueError):
        return None
    if key.public_key() != cert.public_key():
        return None
    return LeafCertificate(
        path=path,
        serial=cert.serial_number,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


@dataclass(frozen=True, kw_only=True)
class LeafSpec:
    """What one of the master's own certificates says: its name, SANs and key usages."""

    name: str
    common_name: str
    sans: list[x509.GeneralName]
    ekus: list[x509.ObjectIdentifier]


def master_client_spec() -> LeafSpec:
    """The certificate the master presents to agents (SAN ``spiffe://mirbadllm/master``)."""
    return LeafSpec(
        name="master-client",
        common_name="mirbadllm-master",
        sans=[x509.UniformResourceIdentifier(MASTER_SPIFFE_ID)],
        ekus=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )


def enroll_spec(addresses: Iterable[str]) -> LeafSpec:
    """The enroll listener's server certificate; agents check it against the CA hash."""
    return LeafSpec(
        name="enroll",
        common_name="mirbadllm-enroll",
        sans=_general_names(addresses),
        ekus=[ExtendedKeyUsageOID.SERVER_AUTH],
    )


def new_leaf(
    ca: CertificateAuthority, spec: LeafSpec, *, lifetime: dt.timedelta
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new key and the certificate the CA signs for it: one of the master's own leaves."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(
        ca, public_key=key.public_key(), common_name=spec.common_name, sans=spec.sans,
        ekus=spec.ekus, lifetime=lifetime,
    )  # fmt: skip
    return key, cert


def leaf_of(path: Path, cert: x509.Certificate) -> LeafCertificate:
    """The record of the leaf ``cert`` whose PEM (key and certificate) is at ``path``."""
    return LeafCertificate(
        path=path,
        serial=cert.serial_number,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


def _ensure_leaf(
    ca: CertificateAuthority,
    *,
    name: str,
    common_name: str,
    sans: list[x509.GeneralName],
    ekus: list[x509.ObjectIdentifier],
    lifetime: dt.timedelta,
) -> LeafCertificate:
    """The leaf ``<pki>/<name>.pem``, re-issued when it is missing or past half life.

    The file-only variant, for a CA made by :func:`load_or_create_ca` (tests; what an
    earlier release kept). The master keeps its leaves in the database through
    ``nodes/master_store.ensure_leaf`` (D80), which follows the same rules.

    Every process calling this (web, monitor, Celery, the enroll listener, each
    every MIRBAD_PKI_CHECK_SECONDS): an exclusive lock on ``<name>.lock`` makes one of
    them re-issue and the others read its result. Key and certificate are one file
    written atomically, so no reader ever loads a key beside another key's certificate.
    """
    pki_dir = ca.cert_path.parent
    path = pki_dir / f"{name}.pem"
    leaf = _read_leaf(path)
    if leaf is not None and _now() < leaf.half_life:
        return leaf
    _ensure_private_dir(pki_dir)
    with open(pki_dir / f"{name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        leaf = _read_leaf(path)  # another process may have re-issued it meanwhile
        if leaf is not None and _now() < leaf.half_life:
            return leaf
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(
            ca,
            public_key=key.public_key(),
            common_name=common_name,
            sans=sans,
            ekus=ekus,
            lifetime=lifetime,
        )
        write_atomic(
            path, _key_pem(key) + cert.public_bytes(serialization.Encoding.PEM), mode=0o600
        )
        # The two files of earlier releases: nothing reads them any more.
        for old in (pki_dir / f"{name}.crt", pki_dir / f"{name}.key"):
            old.unlink(missing_ok=True)
        fresh = _read_leaf(path)
        assert fresh is not None  # just written
        return fresh


def ensure_master_client_certificate(
    ca: CertificateAuthority, *, lifetime: dt.timedelta = MASTER_CERT_LIFETIME
) -> LeafCertificate:
    """The certificate the master presents to agents (SAN ``spiffe://mirbadllm/master``)."""
    return _ensure_leaf(
        ca,
        name="master-client",
        common_name="mirbadllm-master",
        sans=[x509.UniformResourceIdentifier(MASTER_SPIFFE_ID)],
        ekus=[ExtendedKeyUsageOID.CLIENT_AUTH],
        lifetime=lifetime,
    )


def ensure_enroll_certificate(
    ca: CertificateAuthority,
    addresses: Iterable[str],
    *,
    lifetime: dt.timedelta = MASTER_CERT_LIFETIME,
) -> LeafCertificate:
    """The enroll listener's server certificate; agents check it against the CA hash."""
    return _ensure_leaf(
        ca,
        name="enroll",
        common_name="mirbadllm-enroll",
        sans=_general_names(addresses),
        ekus=[ExtendedKeyUsageOID.SERVER_AUTH],
        lifetime=lifetime,
    )


def _has_eku(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> bool:
    try:
        ext = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except x509.ExtensionNotFound:
        return False
    return oid in ext.value


def verify_node_certificate(
    der: bytes,
    *,
    ca_cert: x509.Certificate,
    node_id: str,
    pins: Iterable[str],
    now: dt.datetime | None = None,
) -> x509.Certificate:
    """Accept an agent's certificate only if it is the node we meant to reach.

    Chain to the CA, validity now, EKU serverAuth, exactly one URI SAN equal to
    the node's SPIFFE id, and the SPKI pin among the node's pins (current, or
    pending during a rotation). Raises :class:`PeerRejected` naming the check.
    """
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise PeerRejected(f"node {node_id}: the certificate cannot be parsed ({exc})") from None
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise PeerRejected(f"node {node_id}: the certificate is not issued by this CA") from None
    moment = now or _now()
    if not (cert.not_valid_before_utc <= moment <= cert.not_valid_after_utc):
        raise PeerRejected(
            f"node {node_id}: the certificate is not valid now "
            f"(valid {cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})"
        )
    if not _has_eku(cert, ExtendedKeyUsageOID.SERVER_AUTH):
        raise PeerRejected(f"node {node_id}: the certificate lacks EKU serverAuth")
    uris = uri_sans(cert)
    expected = node_spiffe_id(node_id)
    if len(uris) != 1:
        raise PeerRejected(
            f"node {node_id}: the certificate has {len(uris)} URI SANs; exactly one is allowed"
        )
    if uris[0] != expected:
        raise PeerRejected(f"node {node_id}: the certificate is for {uris[0]}, not {expected}")
    pin = spki_sha256(cert)
    allowed = [p for p in pins if p]
    if pin not in allowed:
        raise PeerRejected(f"node {node_id}: the key {pin} does not match the node's pin")
    return cert


def _pinned_ssl_classes(
    check: Callable[[bytes], object],
) -> tuple[type[ssl.SSLObject], type[ssl.SSLSocket]]:
    """SSL object classes whose handshake also runs ``check`` on the peer certificate.

    Checking inside the handshake, before a single request byte is written,
    works for every client built on ``ssl`` (httpx, aiohttp, asyncio, uvloop),
    so the pin cannot be skipped by a code path that forgets to look.
    """

    def _verify(obj: ssl.SSLObject | ssl.SSLSocket) -> None:
        der = obj.getpeercert(binary_form=True)
        if der is None:
            raise ssl.SSLCertVerificationError("the agent presented no certificate")
        try:
            check(der)
        except PeerRejected as exc:
            raise ssl.SSLCertVerificationError(str(exc)) from None

    class PinnedSSLObject(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()
            _verify(self)

    class PinnedSSLSocket(ssl.SSLSocket):
        def do_handshake(self, block: bool = False) -> None:
            super().do_handshake(block)
            _verify(self)

    return PinnedSSLObject, PinnedSSLSocket


def agent_client_context(
    *,
    ca: x509.Certificate,
    ca_path: Path,
    client_chain: Path,
    node_id: str,
    pins: Iterable[str],
) -> ssl.SSLContext:
    """TLS context for dialing one node: master certificate out, node identity checked in."""
    pin_list = list(pins)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # replaced by the SAN + pin check below
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cafile=str(ca_path))
    context.load_cert_chain(str(client_chain))  # key and certificate, one file
    obj_cls, sock_cls = _pinned_ssl_classes(
        lambda der: verify_node_certificate(der, ca_cert=ca, node_id=node_id, pins=pin_list)
    )
    context.sslobject_class = obj_cls
    context.sslsocket_class = sock_cls
    return context


def new_token() -> str:
    """A join/bootstrap token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
