"""The agent's half of a two-phase certificate rotation (docs/agent-api.md, "Certificate
rotation"; docs/decisions.md D54).

The master drives; the agent keeps one rotation open at a time in ``rotation.json``
beside its identity, with the new key and certificate in ``agent.key.pending`` and
``agent.crt.pending`` until the commit promotes them. Every stage is written
atomically before what it names takes effect, and every step is idempotent per
rotation id, so a repeated step (a lost answer, a master that crashed) answers as
the first did::

    start ──> KeyGenerated ──install──> CertInstalled ──commit──> Committed
                  │                          │
                  └────────── abort ─────────┴──> Aborted

``recover`` runs before the identity is loaded at start: it finishes a promotion a
crash cut short (the stage says Committed first, then the files are replaced, so a
torn pair is finished from the pending files), keeps an installed certificate to be
presented again, and drops pending material that does not match its stage.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent._errors import (
    AlreadyCommitted,
    IdentityError,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotOnPendingCertificate,
)
from agent.identity._tls import (
    CERT_FILE,
    KEY_FILE,
    generate_key_and_csr,
    validate_issued_cert,
)
from protocol.atomic import fsync_directory, write_atomic
from protocol.identity import key_spki_sha256, spki_sha256

__all__ = [
    "PENDING_CERT_FILE",
    "PENDING_KEY_FILE",
    "ROTATION_FILE",
    "ROTATION_ID_RE",
    "Rotation",
    "RotationStore",
    "Stage",
    "check_rotation_id",
    "drop_rotation_state",
]

log = logging.getLogger("mirbad.agent.rotation")

ROTATION_FILE = "rotation.json"
PENDING_KEY_FILE = "agent.key.pending"
PENDING_CERT_FILE = "agent.crt.pending"
ROTATION_ID_RE = re.compile(r"r-[0-9a-f]{8,40}")
_HISTORY = 20  # finished rotations remembered, for repeated steps after the end


class Stage:
    KEY_GENERATED = "KeyGenerated"
    CERT_INSTALLED = "CertInstalled"
    COMMITTED = "Committed"
    ABORTED = "Aborted"


@dataclass(kw_only=True)
class Rotation:
    """One rotation as the agent keeps it."""

    rotation_id: str
    stage: str
    csr_pem: str
    pending_spki: str
    cert_serial: str = ""
    promoted: bool = False  # Committed: the pending files replaced the identity
    updated_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "rotationId": self.rotation_id,
            "stage": self.stage,
            "csrPem": self.csr_pem,
            "pendingSpki": self.pending_spki,
            "certSerial": self.cert_serial,
            "promoted": self.promoted,
            "updatedAt": self.updated_at,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Rotation:
        return cls(
            rotation_id=str(doc["rotationId"]),
            stage=str(doc["stage"]),
            csr_pem=str(doc.get("csrPem", "")),
            pending_spki=str(doc.get("pendingSpki", "")),
            cert_serial=str(doc.get("certSerial", "")),
            promoted=bool(doc.get("promoted", False)),
            updated_at=str(doc.get("updatedAt", "")),
        )

    def answer(self) -> dict[str, Any]:
        """What the API answers for it (no key material, the CSR while it is needed)."""
        out = {
            "rotationId": self.rotation_id,
            "stage": self.stage,
            "pendingSpki": self.pending_spki,
        }
        if self.stage == Stage.KEY_GENERATED:
            out["csrPem"] = self.csr_pem
        if self.cert_serial:
            out["certSerial"] = self.cert_serial
        return out


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def check_rotation_id(value: object) -> str:
    if not isinstance(value, str) or not ROTATION_ID_RE.fullmatch(value):
        raise InvalidRequest(
            "rotationId: expected 'r-' and 8 to 40 lower-case hex digits (the master's id)."
        )
    return value


def drop_rotation_state(state_dir: Path) -> None:
    """Forget any rotation (``join --force``: the identity it belonged to is replaced)."""
    for name in (ROTATION_FILE, PENDING_CERT_FILE, PENDING_KEY_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(state_dir / name)
    if state_dir.is_dir():
        fsync_directory(state_dir)


class RotationStore:
    """``rotation.json`` and the pending files of one state directory.

    Not thread-safe: the agent calls it from its event loop only (a step's file
    writes run to the end there, so a hang-up cannot cut one in half).
    """

    def __init__(self, *, state_dir: Path, node_id: str) -> None:
        self.state_dir = state_dir
        self.node_id = node_id
        self.active: Rotation | None = None
        self.history: list[Rotation] = []
        self._load()

    # -- files ---------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self.state_dir / ROTATION_FILE

    @property
    def pending_key(self) -> Path:
        return self.state_dir / PENDING_KEY_FILE

    @property
    def pending_cert(self) -> Path:
        return self.state_dir / PENDING_CERT_FILE

    def _load(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise IdentityError(
                f"{self.path} cannot be read ({exc}); move it away to drop the rotation "
                "(the master then aborts it and starts a new one)."
            ) from None
        try:
            self.active = Rotation.from_json(doc["active"]) if doc.get("active") else None
            self.history = [Rotation.from_json(r) for r in doc.get("history", [])]
        except (KeyError, TypeError, AttributeError) as exc:
            raise IdentityError(f"{self.path} is not a rotation record: {exc}") from None

    def _save(self) -> None:
        doc = {
            "active": self.active.to_json() if self.active else None,
            "history": [r.to_json() for r in self.history[-_HISTORY:]],
        }
        try:
            write_atomic(self.path, json.dumps(doc, indent=1).encode(), mode=0o600)
        except OSError:
            # Back to what the file holds: no stage may run ahead of it (a commit the
            # master read back as done but the file never got).
            self.active, self.history = None, []
            self._load()
            raise

    def _set_stage(self, rotation: Rotation, stage: str) -> None:
        rotation.stage = stage
        rotation.updated_at = _now()
        self._save()

    def _finish(self) -> None:
        """Move the active rotation to the history (its stage is final)."""
        assert self.active is not None
        self.history.append(self.active)
        self.active = None
        self._save()

    def _drop_pending(self) -> None:
        for path in (self.pending_cert, self.pending_key):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        fsync_directory(self.state_dir)

    def find(self, rotation_id: str) -> Rotation:
        if self.active is not None and self.active.rotation_id == rotation_id:
            return self.active
        for rotation in reversed(self.history):
            if rotation.rotation_id == rotation_id:
                return rotation
        raise NotFound(f"This agent has no rotation '{rotation_id}'.")

    def _open(self, rotation_id: str) -> Rotation:
        """The active rotation ``rotation_id``, or the error a step on it answers."""
        rotation = self.find(rotation_id)
        if rotation is not self.active:
            if rotation.stage == Stage.COMMITTED:
                raise AlreadyCommitted(f"Rotation '{rotation_id}' is already committed.")
            raise InvalidState(
                f"Rotation '{rotation_id}' was aborted; start a new one.",
                details={"stage": rotation.stage},
            )
        return rotation

    # -- the steps -------------------------------------------------------------------------

    def start(self, rotation_id: str) -> tuple[Rotation, bool]:
        """A new key and its CSR; the same CSR for the same id. (rotation, created)."""
        if self.active is not None:
            if self.active.rotation_id == rotation_id:
                return self.active, False
            raise InvalidState(
                f"Rotation '{self.active.rotation_id}' is open on this agent; finish or "
                "abort it first.",
                details={"activeRotationId": self.active.rotation_id},
            )
        for rotation in self.history:
            if rotation.rotation_id == rotation_id:
                raise InvalidState(
                    f"Rotation '{rotation_id}' already ended ({rotation.stage}).",
                    details={"stage": rotation.stage},
                )
        key, csr = generate_key_and_csr(self.node_id)
        # The key first: a crash before the record leaves a pending key that recover()
        # drops as matching no rotation, never a record without its key.
        write_atomic(self.pending_key, _key_pem(key), mode=0o600)
        self.active = Rotation(
            rotation_id=rotation_id,
            stage=Stage.KEY_GENERATED,
            csr_pem=csr.decode(),
            pending_spki=key_spki_sha256(key.public_key()),
            updated_at=_now(),
        )
        self._save()
        log.info("Certificate rotation %s: stage KeyGenerated persisted", rotation_id)
        return self.active, True

    def _pending_key(self) -> ec.EllipticCurvePrivateKey:
        try:
            key = serialization.load_pem_private_key(self.pending_key.read_bytes(), None)
        except (OSError, ValueError) as exc:
            raise IdentityError(f"{self.pending_key} cannot be read: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise IdentityError(f"{self.pending_key} is not an EC private key.")
        return key

    def install(self, rotation_id: str, cert_pem: object, *, ca_cert: x509.Certificate) -> Rotation:
        """Check the certificate against the pending key, this node and the CA; keep it."""
        rotation = self._open(rotation_id)
        if not isinstance(cert_pem, str) or not cert_pem.strip():
            raise InvalidRequest("certPem: the PEM certificate the master signed.")
        try:
            cert = x509.load_pem_x509_certificate(cert_pem.encode())
        except ValueError as exc:
            raise InvalidRequest(f"certPem is not a PEM certificate: {exc}") from None
        serial = format(cert.serial_number, "x")
        if rotation.stage != Stage.KEY_GENERATED:
            if rotation.cert_serial == serial:
                return rotation  # the same step again
            raise InvalidState(
                f"Rotation '{rotation_id}' already holds certificate {rotation.cert_serial}.",
                details={"stage": rotation.stage},
            )
        try:
            validate_issued_cert(
                cert=cert, ca_cert=ca_cert, key=self._pending_key(), node_id=self.node_id
            )
        except IdentityError as exc:
            raise InvalidRequest(f"certPem: {exc}") from None
        try:
            ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            ekus = x509.ExtendedKeyUsage([])
        if ExtendedKeyUsageOID.SERVER_AUTH not in ekus:
            raise InvalidRequest("certPem: the certificate lacks EKU serverAuth.")
        now = dt.datetime.now(dt.UTC)
        if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc:
            raise InvalidRequest(
                f"certPem: the certificate is not valid now (from "
                f"{cert.not_valid_before_utc.isoformat()} to {cert.not_valid_after_utc.isoformat()})."
            )
        write_atomic(self.pending_cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        rotation.cert_serial = serial
        self._set_stage(rotation, Stage.CERT_INSTALLED)
        log.info("Certificate rotation %s: stage CertInstalled persisted", rotation_id)
        return rotation

    def commit(self, rotation_id: str, *, presented_spki: str | None, resumed: bool) -> Rotation:
        """Promote the pending key and certificate; only over a connection that
        negotiated the pending certificate in a full handshake (the master's proof)."""
        try:
            rotation = self._open(rotation_id)
        except AlreadyCommitted:
            return self.find(rotation_id)  # a lost answer: the commit happened
        if rotation.stage != Stage.CERT_INSTALLED:
            raise InvalidState(
                f"Rotation '{rotation_id}' has no installed certificate yet.",
                details={"stage": rotation.stage},
            )
        if presented_spki != rotation.pending_spki or resumed:
            raise NotOnPendingCertificate(
                "Commit only over a new connection that negotiated the pending certificate "
                "(not a pooled or resumed one).",
                details={"presentedSpki": presented_spki or "", "sessionReused": resumed},
            )
        self._set_stage(rotation, Stage.COMMITTED)  # from here there is no way back
        log.info("Certificate rotation %s: stage Committed persisted", rotation_id)
        self._promote(rotation)
        return rotation

    def _promote(self, rotation: Rotation) -> None:
        """Replace agent.key and agent.crt with the pending files (idempotent)."""
        if self.pending_key.is_file() and self.pending_cert.is_file():
            write_atomic(self.state_dir / KEY_FILE, self.pending_key.read_bytes(), mode=0o600)
            write_atomic(self.state_dir / CERT_FILE, self.pending_cert.read_bytes(), mode=0o644)
        self._drop_pending()
        rotation.promoted = True
        self._finish()
        log.info("Certificate rotation %s: the new key and certificate are in use",
                 rotation.rotation_id)  # fmt: skip

    def abort(self, rotation_id: str) -> Rotation:
        """Back to the old material; refused once committed."""
        rotation = self.find(rotation_id)
        if rotation.stage == Stage.COMMITTED:
            raise AlreadyCommitted(f"Rotation '{rotation_id}' is already committed.")
        if rotation is not self.active:
            return rotation  # aborted already
        self._set_stage(rotation, Stage.ABORTED)
        self._drop_pending()
        self._finish()
        log.info("Certificate rotation %s: aborted", rotation_id)
        return rotation

    # -- after a restart -------------------------------------------------------------------

    def recover(self) -> str | None:
        """Bring the files in line with the stage; what was done, or None."""
        rotation = self.active
        if rotation is None:
            if self.pending_key.exists() or self.pending_cert.exists():
                self._drop_pending()
                return "dropped pending files of no rotation"
            return None
        if rotation.stage == Stage.COMMITTED:
            self._promote(rotation)
            return f"finished the promotion of rotation {rotation.rotation_id}"
        if rotation.stage == Stage.ABORTED:
            self._drop_pending()
            self._finish()
            return f"finished the abort of rotation {rotation.rotation_id}"
        if not self.pending_key.is_file():
            # The key is gone: the rotation cannot go on. The master follows (it aborts
            # its side and starts a new rotation).
            self._set_stage(rotation, Stage.ABORTED)
            self._drop_pending()
            self._finish()
            return f"aborted rotation {rotation.rotation_id}: its pending key is missing"
        if rotation.stage == Stage.KEY_GENERATED and self.pending_cert.exists():
            # Written, but the stage was not: the master repeats the install.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pending_cert)
            fsync_directory(self.state_dir)
            return f"dropped an uninstalled certificate of rotation {rotation.rotation_id}"
        if rotation.stage == Stage.CERT_INSTALLED and not self._installed_matches(rotation):
            self._set_stage(rotation, Stage.ABORTED)
            self._drop_pending()
            self._finish()
            return f"aborted rotation {rotation.rotation_id}: its installed certificate is gone"
        return None

    def _installed_matches(self, rotation: Rotation) -> bool:
        try:
            cert = x509.load_pem_x509_certificate(self.pending_cert.read_bytes())
            key = self._pending_key()
        except (OSError, ValueError, IdentityError):
            return False
        return spki_sha256(cert) == key_spki_sha256(key.public_key()) == rotation.pending_spki

    def installed(self) -> tuple[Path, Path, str] | None:
        """(cert, key, SPKI) to present to new connections, while a rotation is installed."""
        rotation = self.active
        if rotation is not None and rotation.stage == Stage.CERT_INSTALLED:
            return self.pending_cert, self.pending_key, rotation.pending_spki
        return None
