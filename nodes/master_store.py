"""The master's CA and its own certificates, kept in the shared database (D80).

Every master host on one database must present the same CA to the agents (each
pins its hash) and the same client identity, so the key pairs live in
:class:`~nodes.models.MasterCredential` rows, the private keys sealed with
AES-256-GCM under a key derived (HKDF-SHA256) from ``MIRBAD_MASTER_KEY``. The
data directory keeps only caches: ``pki/ca.crt`` and ``pki/<leaf>.pem`` (0600),
the files Python's ``ssl`` loads, rewritten from the rows whenever they differ.

Without ``MIRBAD_MASTER_KEY`` (or ``_FILE``) a single-host master uses
``DATA_PATH/master.key``, made once by the first start while the database holds
no sealed key; a second host must be given that value as ``MIRBAD_MASTER_KEY``.
A data directory of an earlier release (``pki/ca.key`` beside ``pki/ca.crt``,
``pki/<leaf>.pem``) is imported into the database once, at its first start.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.db import IntegrityError, connection, transaction

from nodes import pki
from nodes.models import MasterCredential
from protocol.atomic import write_atomic

log = logging.getLogger("mirbad.pki")

CA = "ca"
KEY_FILE = "master.key"
WRONG_KEY = (
    "MIRBAD_MASTER_KEY does not open the keys stored in the database; use the value the "
    "other master hosts use"
)
MISSING_KEY = (
    "MIRBAD_MASTER_KEY is not set (nor MIRBAD_MASTER_KEY_FILE) and {path} does not exist, "
    "but the database already holds the master's keys, sealed by another master host: set "
    "MIRBAD_MASTER_KEY to the value the other master hosts use"
)
_SEAL_VERSION = "v1."
# Fixed, public: HKDF needs no secret salt when the input is a high-entropy key (at
# least 32 characters, checked in core/config.py); the info names what it seals.
_HKDF_SALT = b"mirbadllm master key v1"
_HKDF_INFO = b"mirbadllm master credentials"


class MasterKeyError(pki.PkiError):
    """The master key is missing where the database needs it, or it is the wrong one."""


# -- the master key -------------------------------------------------------------------

_aead: dict[str, AESGCM] = {}  # sha256 of the secret -> its cipher (derived once)


def key_path() -> Path:
    """Where a single-host master keeps the key it made (MIRBAD_MASTER_KEY unset)."""
    return Path(settings.MIRBAD.data_path) / KEY_FILE


def _secret(*, may_create: bool) -> str:
    configured: str | None = settings.MIRBAD.master_key
    if configured:
        return configured
    path = key_path()
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        pass
    if not may_create:
        raise MasterKeyError(MISSING_KEY.format(path=path))
    # First start of a single-host master: make the key once, like the Django secret
    # key (core/config.load_secret_key); racing processes read the winner's.
    value = secrets.token_urlsafe(32)
    try:
        write_atomic(path, value.encode(), mode=0o600, exclusive=True, parents=True)
    except FileExistsError:
        return path.read_text(encoding="utf-8").strip()
    log.warning("Made the master key %s; give its value to any other master host", path)
    return value


def _cipher() -> AESGCM:
    # A key may be made only while no row is sealed: otherwise it could never open them.
    secret = _secret(may_create=not MasterCredential.objects.exists())
    digest = hashlib.sha256(secret.encode()).hexdigest()
    cipher = _aead.get(digest)
    if cipher is None:
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=_HKDF_INFO)
        cipher = _aead[digest] = AESGCM(key.derive(secret.encode()))
    return cipher


def seal(name: str, plaintext: bytes) -> str:
    """``plaintext`` sealed for the row ``name`` (the name is bound as associated data,
    so a sealed key copied into another row does not open)."""
    nonce = os.urandom(12)
    sealed = _cipher().encrypt(nonce, plaintext, name.encode())
    return _SEAL_VERSION + base64.b64encode(nonce + sealed).decode()


def unseal(name: str, sealed: str) -> bytes:
    """The plaintext of a sealed row; :class:`MasterKeyError` when the key is not the one
    that sealed it."""
    if not sealed.startswith(_SEAL_VERSION):
        raise MasterKeyError(f"the master's {name} key in the database is not sealed as v1")
    raw = base64.b64decode(sealed[len(_SEAL_VERSION) :])
    try:
        return _cipher().decrypt(raw[:12], raw[12:], name.encode())
    except InvalidTag:
        raise MasterKeyError(WRONG_KEY) from None


def check_key() -> None:
    """Refuse at start, with the message, when this host's key cannot open the rows."""
    row = MasterCredential.objects.filter(name=CA).first()
    if row is not None:
        unseal(row.name, row.sealed_key)
    else:
        _cipher()


# -- rows -----------------------------------------------------------------------------


def _store_first(name: str, cert_pem: str, key_pem: bytes) -> MasterCredential:
    """Insert the row unless another process or host did first; answers the row kept."""
    sealed = seal(name, key_pem)
    try:
        with transaction.atomic():
            return MasterCredential.objects.create(name=name, cert_pem=cert_pem, sealed_key=sealed)
    except IntegrityError:
        return MasterCredential.objects.get(name=name)


def _private_key(row: MasterCredential) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(unseal(row.name, row.sealed_key), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise pki.PkiError(f"the master's {row.name} key in the database is not an EC key")
    return key


def _write_cache(path: Path, data: bytes) -> None:
    """The file ``ssl`` loads, rewritten only when it differs from the database."""
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, data, mode=0o600)


def _pki_dir() -> Path:
    return Path(settings.MIRBAD.pki_dir)


def close_thread_connection() -> None:
    """Close this thread's connection after a check, on a worker thread outside any
    transaction (the router's and the enroll listener's executors): no request end
    closes it there, and a connection left per thread outlives its use."""
    if threading.current_thread() is threading.main_thread() or connection.in_atomic_block:
        return
    connection.close()


# -- the CA ---------------------------------------------------------------------------


def stored_ca_certificates() -> list[x509.Certificate]:
    """The CA certificates this master has or would import at its first start: the
    database's, and an earlier release's ``pki/ca.crt`` beside ``pki/ca.key``. Writes
    nothing (a rebuild asks this before it installs a CA)."""
    found = [
        x509.load_pem_x509_certificate(row.cert_pem.encode())
        for row in MasterCredential.objects.filter(name=CA)
    ]
    folder = _pki_dir()
    if (folder / "ca.key").exists() and (folder / "ca.crt").exists():
        found.append(x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes()))
    return found


def install_ca(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    """Keep ``cert`` and ``key`` as the CA (a rebuild from a backup); the CA already
    stored stays when it is this one."""
    if key.public_key() != cert.public_key():
        raise pki.PkiError("the key does not match the CA")
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    row = _store_first(CA, pem, pki.key_pem(key))
    if x509.load_pem_x509_certificate(row.cert_pem.encode()) != cert:
        raise pki.PkiError("this master already has another CA in its database")


def _legacy_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    cert_path, key_path = folder / "ca.crt", folder / "ca.key"
    if not (cert_path.exists() and key_path.exists()):
        return None
    ca = pki.load_or_create_ca(folder)
    return ca.cert, ca.key


def load_or_create_ca() -> pki.CertificateAuthority:
    """The CA from the database: imported from an earlier release's data directory, or
    made, at the first start of the first host (once, even with racing processes)."""
    folder = _pki_dir()
    row = MasterCredential.objects.filter(name=CA).first()
    if row is None:
        legacy = _legacy_ca(folder)
        cert, key = legacy or pki.new_ca()
        row = _store_first(CA, cert.public_bytes(serialization.Encoding.PEM).decode(),
                           pki.key_pem(key))  # fmt: skip
        if legacy is not None:
            if x509.load_pem_x509_certificate(row.cert_pem.encode()) == cert:
                # The database holds it now: no plaintext key stays in the data directory.
                (folder / "ca.key").unlink(missing_ok=True)
                log.warning("Imported the CA of %s into the database", folder)
            else:
                log.error("%s holds another CA than the database's; the database's is used",
                          folder)  # fmt: skip
    cert = x509.load_pem_x509_certificate(row.cert_pem.encode())
    cert_path = folder / "ca.crt"
    _write_cache(cert_path, row.cert_pem.encode())
    return pki.CertificateAuthority(cert=cert, key=_private_key(row), cert_path=cert_path)


# -- the master's own leaves ----------------------------------------------------------


@contextlib.contextmanager
def _issuing(name: str) -> Iterator[None]:
    """One issuer of the leaf ``name`` at a time, on every host of the database.

    PostgreSQL: a transaction-scoped advisory lock. SQLite serves one host only: a file
    lock there, as in earlier releases.
    """
    if connection.vendor == "postgresql":
        lock_id = int.from_bytes(hashlib.sha256(f"mirbad-leaf-{name}".encode()).digest()[:8],
                                 "big", signed=True)  # fmt: skip
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [lock_id])
            yield
        return
    folder = _pki_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(folder / f"{name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _usable(
    ca: pki.CertificateAuthority, row: MasterCredential | None
) -> tuple[x509.Certificate, bytes] | None:
    """The row's certificate and key PEM when it is the CA's and before its half life."""
    if row is None:
        return None
    try:
        cert = x509.load_pem_x509_certificate(row.cert_pem.encode())
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):  # any doubt: re-issue
        return None
    leaf = pki.leaf_of(Path(), cert)
    if pki._now() >= leaf.half_life:  # the one clock (tests move it)
        return None
    return cert, unseal(row.name, row.sealed_key)


def _legacy_leaf(ca: pki.CertificateAuthority, path: Path) -> tuple[str, bytes] | None:
    """An earlier release's ``<leaf>.pem`` (key and certificate), if it is the CA's."""
    try:
        data = path.read_bytes()
        cert = x509.load_pem_x509_certificate(data)
        key = serialization.load_pem_private_key(data, password=None)
        cert.verify_directly_issued_by(ca.cert)
    except (OSError, ValueError, TypeError, InvalidSignature):  # not importable
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        return None
    return cert.public_bytes(serialization.Encoding.PEM).decode(), pki.key_pem(key)


def ensure_leaf(
    ca: pki.CertificateAuthority, spec: pki.LeafSpec, *, lifetime: dt.timedelta
) -> pki.LeafCertificate:
    """The leaf ``spec.name`` from the database, re-issued when it is missing, not the
    CA's or past half life; its cache ``pki/<name>.pem`` (key and certificate, one file
    written atomically) is what ``load_cert_chain`` reads.

    Every master process on every host calls this every MIRBAD_PKI_CHECK_SECONDS: one
    issues under :func:`_issuing`, the others read its row.
    """
    path = _pki_dir() / f"{spec.name}.pem"
    row = MasterCredential.objects.filter(name=spec.name).first()
    if row is None:
        legacy = _legacy_leaf(ca, path)
        if legacy is not None:
            row = _store_first(spec.name, *legacy)
            log.info("Imported %s into the database", path)
    found = _usable(ca, row)
    if found is None:
        with _issuing(spec.name):
            row = MasterCredential.objects.filter(name=spec.name).first()
            found = _usable(ca, row)  # another process may have re-issued it meanwhile
            if found is None:
                key, cert = pki.new_leaf(ca, spec, lifetime=lifetime)
                key_pem = pki.key_pem(key)
                MasterCredential.objects.update_or_create(
                    name=spec.name,
                    defaults={
                        "cert_pem": cert.public_bytes(serialization.Encoding.PEM).decode(),
                        "sealed_key": seal(spec.name, key_pem),
                    },
                )
                found = cert, key_pem
    cert, key_pem = found
    _write_cache(path, key_pem + cert.public_bytes(serialization.Encoding.PEM))
    return pki.leaf_of(path, cert)


def ensure_master_client_certificate(
    ca: pki.CertificateAuthority, *, lifetime: dt.timedelta = pki.MASTER_CERT_LIFETIME
) -> pki.LeafCertificate:
    """The certificate every master host presents to agents."""
    return ensure_leaf(ca, pki.master_client_spec(), lifetime=lifetime)


def ensure_enroll_certificate(
    ca: pki.CertificateAuthority,
    addresses: list[str],
    *,
    lifetime: dt.timedelta = pki.MASTER_CERT_LIFETIME,
) -> pki.LeafCertificate:
    """The enroll listener's server certificate (agents check it against the CA hash, not
    the name, so one certificate serves every host's listener)."""
    return ensure_leaf(ca, pki.enroll_spec(addresses), lifetime=lifetime)
