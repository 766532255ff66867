"""Node registry operations: bootstrap, enrollment, tokens, the master's PKI files.

Views, the enroll listener, Celery tasks and the launcher call these; none of
them decides anything on its own.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TypeGuard

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.config import MasterConfig
from core.errors import ServiceError
from nodes import audit, events, fencing, master_store, pki
from nodes.models import JoinToken, Node
from protocol.atomic import write_atomic
from protocol.names import NODE_ID_RE

log = logging.getLogger("mirbad.nodes")


class EnrollmentRefused(Exception):
    """An enrollment request was refused; ``code`` and ``status`` go to the agent."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def config() -> MasterConfig:
    return settings.MIRBAD


@dataclass(frozen=True, kw_only=True)
class MasterPki:
    """The CA and the master's client certificate as this process last checked them."""

    ca: pki.CertificateAuthority
    client: pki.LeafCertificate


_pki_lock = threading.Lock()
_pki_state: dict[str, tuple[float, MasterPki]] = {}  # pki dir -> (next check, what it found)


def master_pki() -> MasterPki:
    """The CA and the master's client certificate from the database (shared by every
    master host, ``nodes/master_store.py``), created on first use.

    Checked again every MIRBAD_PKI_CHECK_SECONDS and re-issued at half life
    (``master_store.ensure_master_client_certificate``), so a process that runs for years
    never presents an expired certificate (docs/decisions.md D53). Between checks it
    costs a clock read.
    """
    cfg = config()
    key = str(cfg.pki_dir)
    now = time.monotonic()
    cached = _pki_state.get(key)
    if cached is not None and now < cached[0]:
        return cached[1]
    # The database is read (on a worker thread when this one runs an event loop: the
    # monitor's and the router's clients ask here).
    try:
        return fencing.off_loop(lambda: _check_pki(cfg, key, now))
    finally:
        master_store.close_thread_connection()


def _check_pki(cfg: MasterConfig, key: str, now: float) -> MasterPki:
    with _pki_lock:
        cached = _pki_state.get(key)
        if cached is not None and now < cached[0]:
            return cached[1]
        # The CA never changes under a running process (a rebuild installs it before the
        # first start, and calls forget_master_pki); the leaf may, on any host.
        ca = cached[1].ca if cached is not None else master_store.load_or_create_ca()
        client = master_store.ensure_master_client_certificate(
            ca, lifetime=dt.timedelta(seconds=cfg.master_cert_seconds)
        )
        if cached is not None and cached[1].client.serial != client.serial:
            log.info(
                "The master's client certificate is now %x (valid until %s)",
                client.serial, client.not_after.isoformat(),
            )  # fmt: skip
        found = MasterPki(ca=ca, client=client)
        _pki_state[key] = (now + cfg.pki_check_seconds, found)
        return found


def forget_master_pki() -> None:
    """Drop what this process knows of the PKI: the next use reads the database again."""
    with _pki_lock:
        _pki_state.clear()
    _context_cached.cache_clear()


def ensure_bootstrap_node() -> Node:
    """The record of the agent on the master's own host: pre-approved, without a pin."""
    cfg = config()
    node, created = Node.objects.get_or_create(
        node_id=cfg.bootstrap_node_id,
        defaults={
            "address": cfg.bootstrap_agent_address,
            "is_bootstrap": True,
            "approved": True,
            "display_name": "This machine",
        },
    )
    if created:
        log.info("Created the bootstrap node record %s at %s", node.node_id, node.address)
    elif node.is_bootstrap and node.address != cfg.bootstrap_agent_address:
        # MIRBAD_AGENT_PORT moved: follow it, the identity stays the pin.
        node.address = cfg.bootstrap_agent_address
        node.save(update_fields=["address", "updated_at"])
    return node


def create_token(*, node_id: str, purpose: str, lifetime: dt.timedelta) -> str:
    """A new single-use token; only its hash is stored, the token is returned once."""
    token = pki.new_token()
    JoinToken.objects.create(
        token_hash=pki.hash_token(token),
        node_id=node_id,
        purpose=purpose,
        expires_at=timezone.now() + lifetime,
    )
    return token


def bundle_path() -> Path:
    return config().bootstrap_dir / "bootstrap.json"


def write_bootstrap_bundle(*, force: bool = False) -> Path | None:
    """Keep a valid bundle for the bootstrap node while it is not enrolled.

    Re-run every 5 minutes by Celery beat; it renews the token one hour before
    it expires and removes a leftover bundle once the node holds a pin.
    """
    cfg = config()
    node = ensure_bootstrap_node()
    path = bundle_path()
    if node.enrolled:
        path.unlink(missing_ok=True)
        return None
    if not force and path.exists():
        try:
            current = json.loads(path.read_text())
            expires = dt.datetime.fromisoformat(current["expiresAt"])
            usable = JoinToken.objects.filter(
                token_hash=pki.hash_token(current["token"]), used_at__isnull=True
            ).exists()
            if usable and expires - timezone.now() > dt.timedelta(hours=1):
                return path
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("The bootstrap bundle %s is unreadable; writing a new one", path)
    mp = master_pki()
    lifetime = dt.timedelta(hours=cfg.bootstrap_token_hours)
    with transaction.atomic():
        # Old unused bootstrap tokens die with the bundle that carried them.
        JoinToken.objects.filter(
            node_id=node.node_id, purpose=JoinToken.Purpose.BOOTSTRAP, used_at__isnull=True
        ).delete()
        token = create_token(
            node_id=node.node_id, purpose=JoinToken.Purpose.BOOTSTRAP, lifetime=lifetime
        )
    now = timezone.now()
    bundle = {
        "nodeId": node.node_id,
        "token": token,
        "caCertPem": mp.ca.cert_pem,
        "caSpkiSha256": mp.ca.spki_sha256,
        "enrollEndpoint": cfg.enroll_endpoint,
        "createdAt": now.isoformat(),
        "expiresAt": (now + lifetime).isoformat(),
    }
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)
    write_atomic(path, json.dumps(bundle, indent=2).encode(), mode=0o600, parents=True)
    log.info("Wrote the bootstrap bundle for node %s to %s", node.node_id, path)
    return path


def _refuse(code: str, message: str, status: int) -> EnrollmentRefused:
    log.warning("Enrollment refused (%s): %s", code, message)
    return EnrollmentRefused(code, message, status)


def enroll(
    *,
    token: str,
    node_id: str,
    csr_pem: str,
    addresses: list[str],
    agent_version: str = "",
    protocol_versions: list[int] | None = None,
) -> dict[str, object]:
    """Redeem a single-use token for a node certificate; the pin is recorded.

    The token row is locked and marked used in the same transaction that
    records the pin, so two agents racing with one token get one certificate.
    """
    if not isinstance(token, str) or not token:
        raise _refuse("token_invalid", "The enrollment token is missing.", 401)
    mp = master_pki()
    with transaction.atomic():
        row = JoinToken.objects.select_for_update().filter(token_hash=pki.hash_token(token)).first()
        if row is None:
            raise _refuse(
                "token_invalid",
                "The enrollment token is not known to this master; ask for a new one.",
                401,
            )
        if row.used_at is not None:
            raise _refuse(
                "token_used",
                "The enrollment token was already used; each token enrolls one node once.",
                401,
            )
        if row.expires_at <= timezone.now():
            raise _refuse(
                "token_expired", "The enrollment token has expired; ask for a new one.", 401
            )
        if row.node_id != node_id:
            raise _refuse(
                "invalid_request",
                f"The token is for node '{row.node_id}', not '{node_id}'.",
                400,
            )
        node = Node.objects.select_for_update().filter(node_id=node_id).first()
        if node is not None and node.revoked:
            raise _refuse(
                "node_revoked",
                f"Node '{node_id}' is revoked; it cannot enroll again under that id.",
                403,
            )
        if row.purpose == JoinToken.Purpose.REKEY and node is None:
            raise _refuse("invalid_request", f"Node '{node_id}' does not exist to rekey.", 400)
        if row.purpose == JoinToken.Purpose.JOIN and node is not None and node.enrolled:
            raise _refuse(
                "node_enrolled",
                f"Node '{node_id}' is already enrolled; ask the operator for a rekey.",
                409,
            )
        if row.purpose == JoinToken.Purpose.BOOTSTRAP:
            if node is None or not node.is_bootstrap:
                raise _refuse("invalid_request", f"'{node_id}' is not the bootstrap node.", 400)
            if node.enrolled:
                # An old bundle must never take over an enrolled node.
                raise _refuse(
                    "node_enrolled",
                    f"Node '{node_id}' is already enrolled; a bootstrap token cannot replace it.",
                    409,
                )
        try:
            cert = pki.issue_node_certificate(
                mp.ca,
                csr_pem=csr_pem,
                node_id=node_id,
                lifetime=dt.timedelta(seconds=config().node_cert_seconds),
            )
        except pki.PkiError as exc:
            raise _refuse("invalid_request", str(exc), 400) from None
        if node is None:
            address = addresses[0] if addresses else ""
            node = Node(node_id=node_id, address=address, approved=False)
        if addresses and not node.is_bootstrap:
            node.address = addresses[0]
        node.spki_pin = pki.spki_sha256(cert)
        node.pending_pin = ""
        node.cert_serial = format(cert.serial_number, "x")
        node.cert_not_after = cert.not_valid_after_utc
        node.enrolled_at = timezone.now()
        node.agent_version = agent_version[:40]
        node.save()
        row.used_at = timezone.now()
        row.save(update_fields=["used_at"])
        # A new pin (join or rekey): the monitor dials with it now, not at its next refresh.
        events.tell_monitor(node_id)
    log.info(
        "Enrolled node %s, key %s (approved: %s)", node_id, pki.fingerprint(cert), node.approved
    )
    if node.is_bootstrap:
        transaction.on_commit(lambda: bundle_path().unlink(missing_ok=True))
    return {
        "nodeId": node_id,
        "certPem": cert.public_bytes(serialization.Encoding.PEM).decode(),
        "caCertPem": mp.ca.cert_pem,
        "approved": node.approved,
        "fingerprint": pki.fingerprint(cert),
    }


def node_ssl_context(node: Node) -> ssl.SSLContext:
    """The pinned TLS context for dialing ``node``: one per pin set and client
    certificate, so a re-issued certificate goes out on new connections."""
    mp = master_pki()
    return _context_cached(
        str(mp.ca.cert_path), str(mp.client.path), mp.client.serial, node.node_id,
        tuple(node.pins),
    )  # fmt: skip


@lru_cache(maxsize=1024)
def _context_cached(
    ca_path: str, chain: str, serial: int, node_id: str, pins: tuple[str, ...]
) -> ssl.SSLContext:
    # ``serial`` is only the key: the file at ``chain`` holds that certificate until
    # its half life, and a context loads it once, here.
    ca = x509.load_pem_x509_certificate(Path(ca_path).read_bytes())
    return pki.agent_client_context(
        ca=ca, ca_path=Path(ca_path), client_chain=Path(chain), node_id=node_id, pins=pins
    )


def _node_or_404(node_id: str) -> Node:
    node = Node.objects.filter(node_id=node_id).first()
    if node is None:
        raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
    return node


def create_join_token(*, node_id: object, lifetime_minutes: object = None) -> dict[str, object]:
    """A single-use token for a new node and the exact command to run on it.

    The token is returned once and stored only as its hash. A node id that is
    already enrolled (or revoked) is refused: that is what rekey is for.
    """

    if not isinstance(node_id, str) or not NODE_ID_RE.fullmatch(node_id):
        raise ServiceError(
            400,
            "invalid_request",
            "nodeId: use lower-case letters, digits and '-', starting with a letter or digit "
            "(at most 40 characters).",
        )
    existing = Node.objects.filter(node_id=node_id).first()
    if existing is not None and existing.revoked:
        raise ServiceError(409, "node_revoked", f"Node '{node_id}' is revoked; pick another id.")
    if existing is not None and existing.enrolled:
        raise ServiceError(
            409, "node_enrolled", f"Node '{node_id}' is already enrolled; use rekey instead."
        )
    return _issue_token(node_id, JoinToken.Purpose.JOIN, lifetime_minutes)


def _issue_token(node_id: str, purpose: str, lifetime_minutes: object) -> dict[str, object]:
    """Create a join or rekey token and the answer shown once: token, CA hash, command."""
    cfg = config()
    minutes = cfg.join_token_minutes if lifetime_minutes is None else lifetime_minutes
    if isinstance(minutes, bool) or not isinstance(minutes, int) or not 1 <= minutes <= 10080:
        raise ServiceError(
            400, "invalid_request", "lifetimeMinutes: a whole number from 1 to 10080."
        )
    token = create_token(node_id=node_id, purpose=purpose, lifetime=dt.timedelta(minutes=minutes))
    ca_hash = "sha256:" + master_pki().ca.spki_sha256
    expires = timezone.now() + dt.timedelta(minutes=minutes)
    force = " --force" if purpose == JoinToken.Purpose.REKEY else ""
    command = (
        f"MIRBAD_JOIN_TOKEN=<token> python -m agent join{force} --enroll-url "
        f"{cfg.enroll_endpoint} --ca-hash {ca_hash} --node-id {node_id} "
        "--state-dir /var/lib/mirbad-agent --address https://<this machine>:9443"
    )
    log.info("Created a %s token for node %s (expires %s)", purpose, node_id, expires.isoformat())
    # The token itself never goes in: only that one was issued, for what, until when.
    audit.record(f"node.{purpose!s}_token_issued", node_id=node_id, expiresAt=expires.isoformat())
    return {
        "nodeId": node_id,
        "token": token,
        "expiresAt": expires.isoformat(),
        "enrollUrl": cfg.enroll_endpoint,
        "caHash": ca_hash,
        "command": command,
    }


def approve_node(node_id: str) -> Node:
    """Approval is the trust gate: before it the monitor sends the node nothing."""
    node = _node_or_404(node_id)
    if node.revoked:
        raise ServiceError(409, "node_revoked", f"Node '{node_id}' is revoked.")
    if not node.enrolled:
        raise ServiceError(409, "invalid_state", f"Node '{node_id}' has not enrolled yet.")
    if not node.approved:
        node.approved = True
        node.save(update_fields=["approved", "updated_at"])
        log.info("Approved node %s (key SHA256:%s)", node_id, node.spki_pin)
        audit.record("node.approved", node_id=node_id, keyPin=node.spki_pin)
        events.tell_monitor(node_id)
    return node


def revoke_node(node_id: str) -> Node:
    """Drop the node's pins and refuse it from now on (connections and enrollment).

    Readers see it Revoked at once (the registry decides, nodes.status); the monitor,
    told, stops following it and publishes the change.
    """
    node = _node_or_404(node_id)
    node.revoked = True
    node.spki_pin = ""
    node.pending_pin = ""
    node.save(update_fields=["revoked", "spki_pin", "pending_pin", "updated_at"])
    JoinToken.objects.filter(node_id=node_id, used_at__isnull=True).delete()
    events.tell_monitor(node_id)
    log.warning("Revoked node %s", node_id)
    audit.record("node.revoked", node_id=node_id)
    return node


def set_draining(node_id: str, draining: bool) -> Node:
    """Draining: no new starts or placements; running models keep serving."""
    node = _node_or_404(node_id)
    if node.draining != draining:
        node.draining = draining
        node.save(update_fields=["draining", "updated_at"])
        log.info("Node %s draining: %s", node_id, draining)
        events.tell_monitor(node_id)
    return node


MAX_MAINTENANCE_SECONDS = 7 * 24 * 3600


def start_maintenance(node_id: str, *, seconds: object, reason: object = "") -> Node:
    """Hold a node for maintenance: /v1 stops routing to it and answers 503 maintenance.

    ``seconds`` is the job's estimate (it becomes the Retry-After); the hold ends by
    itself when it runs out, or earlier with ``end_maintenance``. Running engines
    keep running: the holder (a benchmark, a tune, an operator) uses them.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise ServiceError(
            400, "invalid_request", "seconds: give the hold's length as a whole number of seconds"
        )
    if not 1 <= seconds <= MAX_MAINTENANCE_SECONDS:
        raise ServiceError(
            400,
            "invalid_request",
            f"seconds: {seconds} is out of range; use 1 to {MAX_MAINTENANCE_SECONDS} (7 days)",
        )
    if reason is None:
        reason = ""
    if not isinstance(reason, str) or len(reason) > 200:
        raise ServiceError(400, "invalid_request", "reason: give a text of at most 200 characters")
    node = _node_or_404(node_id)
    node.maintenance_until = timezone.now() + dt.timedelta(seconds=seconds)
    node.maintenance_reason = reason.strip()
    node.save(update_fields=["maintenance_until", "maintenance_reason", "updated_at"])
    log.info("Node %s held for maintenance for %d s: %s", node_id, seconds, reason or "-")
    events.tell_monitor(node_id)
    return node


def end_maintenance(node_id: str) -> Node:
    """End a node's maintenance hold (nothing happens when there is none)."""
    node = _node_or_404(node_id)
    if node.maintenance_until is not None or node.maintenance_reason:
        node.maintenance_until = None
        node.maintenance_reason = ""
        node.save(update_fields=["maintenance_until", "maintenance_reason", "updated_at"])
        log.info("Node %s maintenance ended", node_id)
        events.tell_monitor(node_id)
    return node


def rekey_node(node_id: str, *, lifetime_minutes: object = None) -> dict[str, object]:
    """A single-use token that re-enrolls a node whose identity was lost.

    The node keeps its record, approval and placements; enrolling with the
    token replaces its pin, so the monitor reconnects with the new key while
    the engines on the node keep running.
    """
    node = _node_or_404(node_id)
    if node.revoked:
        raise ServiceError(409, "node_revoked", f"Node '{node_id}' is revoked.")
    JoinToken.objects.filter(
        node_id=node_id, purpose=JoinToken.Purpose.REKEY, used_at__isnull=True
    ).delete()
    return _issue_token(node_id, JoinToken.Purpose.REKEY, lifetime_minutes)


def set_reserves(
    node_id: str, *, memory_reserve: object, gpu_reserves: object, unknown: list[str]
) -> Node:
    """Set the memory admission keeps free on a node: host RAM and per GPU UUID."""
    if unknown:
        raise ServiceError(
            400,
            "invalid_request",
            f"{unknown[0]}: unknown field; known fields are gpuReserves, memoryReserveBytes",
        )
    node = _node_or_404(node_id)

    def nonnegative(value: object) -> TypeGuard[int]:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**50

    fields = []
    if memory_reserve is not None:
        if not nonnegative(memory_reserve):
            raise ServiceError(
                400, "invalid_request", "memoryReserveBytes: must be a byte count of 0 or more"
            )
        node.memory_reserve_bytes = memory_reserve
        fields.append("memory_reserve_bytes")
    if gpu_reserves is not None:
        known = {g.get("uuid") for g in (node.facts or {}).get("gpus") or [] if isinstance(g, dict)}
        if not isinstance(gpu_reserves, dict):
            raise ServiceError(
                400, "invalid_request", "gpuReserves: must map GPU UUIDs to byte counts"
            )
        for uuid, value in gpu_reserves.items():
            if uuid not in known:
                have = ", ".join(sorted(k for k in known if k)) or "none"
                raise ServiceError(
                    400,
                    "invalid_request",
                    f"gpuReserves: node '{node_id}' has no GPU {uuid} (it reported: {have})",
                )
            if not nonnegative(value):
                raise ServiceError(
                    400, "invalid_request", f"gpuReserves.{uuid}: must be a byte count of 0 or more"
                )
        node.gpu_reserves = {**(node.gpu_reserves or {}), **gpu_reserves}
        fields.append("gpu_reserves")
    if fields:
        node.save(update_fields=[*fields, "updated_at"])
    return node


def node_from_param(value: str | None, *, action: str) -> Node:
    """The ``?node=`` rules of docs/operator-guide.md, "Models through /api", for routes that act on one node."""

    from nodes import status

    if value is None or value == "":
        members = list(Node.objects.filter(revoked=False)[:2])
        if len(members) > 1:
            raise ServiceError(
                400,
                "node_required",
                "More than one node exists; name the node with ?node=<id>.",
            )
        if not members:
            raise ServiceError(404, "not_found", "No node exists yet.")
        node = members[0]
    else:
        if not NODE_ID_RE.fullmatch(value):
            raise ServiceError(400, "invalid_request", "?node= is not a valid node id.")
        found = Node.objects.filter(node_id=value, revoked=False).first()
        if found is None:
            raise ServiceError(404, "not_found", f"Node '{value}' does not exist.")
        node = found
    if not node.approved:
        raise ServiceError(
            409,
            "invalid_state",
            f"Node '{node.node_id}' is not approved yet; approve it first.",
        )
    status.require_serving(node, f"{action} cannot be done now")
    return node


def read_gguf(*, node_param: str | None, folder: str, file: str | None) -> dict[str, object]:
    """The header summary of a GGUF on a node (GET /api/model-folders/{folder}/gguf)."""
    from nodes.agent_client import (
        AgentClient,
        AgentRefused,
        AgentUnreachable,
        check_file,
        check_folder,
    )

    check_folder(folder)  # before any node is picked: a bad name is the caller's 400
    if file is not None:
        check_file(file)
    node = node_from_param(node_param, action="reading its GGUF files")
    features = (node.facts or {}).get("features") or []
    if "gguf.inspect" not in features:
        raise ServiceError(
            501,
            "not_supported",
            f"Node '{node.node_id}' cannot read GGUF headers (feature 'gguf.inspect').",
        )
    try:
        with AgentClient(node=node) as client:
            result = client.gguf(folder, file)
    except AgentUnreachable as exc:
        raise ServiceError(503, "node_unreachable", str(exc)) from exc
    except AgentRefused as exc:
        raise ServiceError(
            exc.status if exc.status in (400, 404, 422) else 502,
            exc.code,
            exc.message,
            details=exc.details,
        ) from exc
    return {"node": node.node_id, **result}
