"""Two-phase renewal of a node's certificate, driven by the master (docs/operator-guide.md,
"Certificates"; docs/decisions.md D55).

The stages of a ``CertRotation`` and the step each one names::

    Requested      start: the agent makes a key and answers its CSR (the same on a retry)
    CsrReceived    the master signs the CSR
    CertIssued     the new pin is the node's pending pin: the master's connections accept
                   either; after the pin grace the certificate goes to the agent
    CertInstalled  the agent presents it to new connections; the proof: a new
                   connection pinned to the new key only reads the rotation
    Committing     no way back from here; commit goes over a connection pinned the same way
    Committed      the pending pin becomes the pin, the old one is gone
    Aborted        both sides are back on the old certificate (only before Committing)

Every stage is saved before its step, so :func:`advance` resumes a rotation from
whatever stage a crashed master stored; every step is idempotent on the agent, so a
step whose answer was lost is simply sent again. When the agent's stage differs from
the record (a lost answer, a restart, an abort the master did not see), the record
follows the agent while that is safe and the rotation is aborted on both sides when
it is not.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import uuid
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from core.errors import ServiceError
from nodes import audit, events, pki
from nodes.agent_client import (
    AgentClient,
    AgentError,
    AgentRefused,
    AgentUnreachable,
    agent_url,
    check_answer,
)
from nodes.models import CertRotation, Node
from nodes.services import config, master_pki
from protocol.identity import key_spki_sha256

__all__ = [
    "abort",
    "advance",
    "certificate_summary",
    "drive",
    "due_for_renewal",
    "next_pass_in",
    "renew_at",
    "request_rotation",
]

log = logging.getLogger("mirbad.rotation")

Stage = CertRotation.Stage
FEATURE = "pki.rotation"


class RotationFailed(Exception):
    """A step failed; the rotation stays at its stage and the next pass retries it."""


def _new_id() -> str:
    return "r-" + uuid.uuid4().hex


# -- when --------------------------------------------------------------------------------


def renew_at(node: Node) -> dt.datetime | None:
    """When the node's certificate is due: MIRBAD_CERT_RENEW_BEFORE_SECONDS before its
    expiry, minus a jitter fixed per node and certificate (a fleet enrolled on one day
    does not renew in one minute, and a restart does not draw it again)."""
    if node.cert_not_after is None:
        return None
    cfg = config()
    window = max(cfg.cert_renew_jitter_seconds, 0)
    digest = hashlib.sha256(f"{node.node_id}/{node.cert_serial}".encode()).digest()
    jitter = int.from_bytes(digest[:8], "big") % (window + 1)
    return node.cert_not_after - dt.timedelta(seconds=cfg.cert_renew_before_seconds + jitter)


def due_for_renewal(now: dt.datetime | None = None) -> list[Node]:
    """Approved, enrolled nodes whose certificate is due and that have no open rotation."""
    moment = now or timezone.now()
    nodes = Node.objects.filter(approved=True, revoked=False).exclude(spki_pin="")
    busy = set(CertRotation.objects.filter(open=True).values_list("node_id", flat=True))
    due = []
    for node in nodes:
        at = renew_at(node)
        if node.pk not in busy and at is not None and at <= moment:
            due.append(node)
    return due


# -- what the console shows -------------------------------------------------------------


def _iso(moment: dt.datetime | None) -> str | None:
    return moment.astimezone(dt.UTC).isoformat() if moment is not None else None


def certificate_summary(
    node: Node, open_rotation: CertRotation | None = None, *, looked_up: bool = False
) -> events.CertificateSummary:
    """The node's certificate and its open rotation: what the Overview's Certificate
    cell and the node page render, and what ``node.certificate`` carries.

    ``looked_up``: the caller already read the open rotation (a list page prefetches
    them for every node), so None means there is none, not "go and look".
    """
    active = open_rotation
    if active is None and not looked_up:
        active = CertRotation.objects.filter(node=node, open=True).first()
    return events.CertificateSummary(
        nodeId=node.node_id,
        serial=node.cert_serial,
        notAfter=_iso(node.cert_not_after),
        renewAt=_iso(renew_at(node)),
        renewalError=node.cert_renewal_error,
        rotation=None
        if active is None
        else events.RotationSummary(
            rotationId=active.rotation_id,
            stage=active.stage,
            reason=active.reason,
            attempts=active.attempts,
            lastError=active.last_error,
        ),
    )


def _announce(node_pk: int) -> None:
    """After the commit: the console's pages show the stored certificate and stage."""

    def build() -> events.CertificateUpdated:
        node = Node.objects.get(pk=node_pk)
        return events.CertificateUpdated(
            type="node.certificate", certificate=certificate_summary(node)
        )

    events.publish_after_commit(build)


# -- starting and aborting ---------------------------------------------------------------


def request_rotation(
    node_id: str, *, reason: str = CertRotation.Reason.OPERATOR, actor: str = "system"
) -> CertRotation:
    """Open a rotation for the node (409 invalid_state naming the open one, if any)."""
    node = Node.objects.filter(node_id=node_id).first()
    if node is None:
        raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
    if node.revoked or not node.approved or not node.spki_pin:
        raise ServiceError(
            409, "invalid_state",
            f"Node '{node_id}' is not an approved, enrolled node; only those rotate.",
        )  # fmt: skip
    features = (node.facts or {}).get("features") or []
    if FEATURE not in features:
        raise ServiceError(
            501, "not_supported",
            f"Node '{node_id}''s agent does not offer '{FEATURE}'; upgrade it, or rekey the node.",
        )  # fmt: skip
    active = CertRotation.objects.filter(node=node, open=True).first()
    if active is not None:
        raise _already_open(node_id, active)
    try:
        with transaction.atomic():
            rotation = CertRotation.objects.create(
                rotation_id=_new_id(), node=node, reason=reason, stage=Stage.REQUESTED
            )
            audit.record("rotation.requested", actor=actor, node_id=node_id,
                         subject=rotation.rotation_id, reason=reason)  # fmt: skip
            _announce(node.pk)
    except IntegrityError:
        active = CertRotation.objects.filter(node=node, open=True).first()
        raise _already_open(node_id, active) from None
    log.info("Certificate rotation %s of node %s: stage Requested persisted (%s)",
             rotation.rotation_id, node_id, reason)  # fmt: skip
    return rotation


def _already_open(node_id: str, active: CertRotation | None) -> ServiceError:
    return ServiceError(
        409, "invalid_state", f"Node '{node_id}' has a rotation open already.",
        details={"activeRotationId": active.rotation_id if active else ""},
    )  # fmt: skip


def abort(rotation_id: str) -> CertRotation:
    """Both sides back to the old certificate; 409 already_committed from Committing on."""
    rotation = CertRotation.objects.select_related("node").get(rotation_id=rotation_id)
    if rotation.stage in (Stage.COMMITTING, Stage.COMMITTED):
        raise ServiceError(
            409,
            "already_committed",
            f"Rotation '{rotation_id}' is committed; it cannot be aborted.",
        )
    if not rotation.open:
        return rotation
    with AgentClient(node=rotation.node) as client:
        try:
            client.rotation_abort(rotation_id)
        except AgentRefused as exc:
            if exc.code == "already_committed":
                # The commit happened and its answer was lost: follow the agent.
                _set(rotation, Stage.COMMITTING)
                return advance(rotation_id)
            if exc.code != "not_found":
                raise
    _finish_aborted(rotation, "aborted")
    return rotation


def _finish_aborted(rotation: CertRotation, why: str) -> None:
    """The master's side of an abort: the pending pin goes, the record closes."""
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=rotation.node_id)
        if rotation.pending_spki and node.pending_pin == rotation.pending_spki:
            node.pending_pin = ""
            node.save()
        rotation.stage = Stage.ABORTED
        rotation.open = False
        rotation.finished_at = timezone.now()
        rotation.last_error = why[:500]
        rotation.save()
        audit.record("rotation.aborted", node_id=node.node_id, subject=rotation.rotation_id,
                     why=why[:300])  # fmt: skip
        events.tell_monitor(node.node_id)
        _announce(node.pk)
    log.info("Certificate rotation %s of node %s: aborted (%s)",
             rotation.rotation_id, rotation.node.node_id, why)  # fmt: skip


# -- driving ------------------------------------------------------------------------------


def _set(rotation: CertRotation, stage: str, **fields: Any) -> None:
    for name, value in fields.items():
        setattr(rotation, name, value)
    rotation.stage = stage
    with transaction.atomic():
        rotation.save()
        audit.record("rotation.stage", node_id=rotation.node.node_id,
                     subject=rotation.rotation_id, stage=stage)  # fmt: skip
        _announce(rotation.node_id)
    log.info("Certificate rotation %s of node %s: stage %s persisted",
             rotation.rotation_id, rotation.node.node_id, stage)  # fmt: skip


def _lease() -> dt.timedelta:
    return dt.timedelta(seconds=config().rotation_lease_seconds)


def _take_lease(rotation_id: str) -> bool:
    """One pass at a time per rotation (an UPDATE that only one of them can win)."""
    now = timezone.now()
    taken = (
        CertRotation.objects.filter(rotation_id=rotation_id, open=True)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .update(lease_until=now + _lease())
    )
    return taken == 1


def _renew_lease(rotation_id: str) -> None:
    """Before each step: a pass killed mid-way holds the rotation one lease at most, and
    a long pass does not lose it to a second one."""
    CertRotation.objects.filter(rotation_id=rotation_id).update(
        lease_until=timezone.now() + _lease()
    )


def advance(rotation_id: str, *, steps: int = 12) -> CertRotation:
    """Take the rotation as far as it goes now (its stage and record saved at each step).

    Returns at the end, at the pin grace (the next pass installs), or when a step
    fails (its error recorded on the rotation; the next pass retries from the stage).
    A rotation another pass holds is returned as it is.
    """
    reached = _pass(rotation_id, steps=steps)
    if reached is None:
        return CertRotation.objects.select_related("node").get(rotation_id=rotation_id)
    return reached


def drive(rotation_id: str) -> tuple[CertRotation, float | None]:
    """A pass, and in how many seconds the next one should come (None: not before the
    beat's). What Celery runs for "rotate now": it does not wait an hour for the beat
    at the pin grace or after a step that failed once."""
    reached = _pass(rotation_id, steps=12)
    if reached is None:  # another pass holds it and schedules its own follow-up
        return CertRotation.objects.select_related("node").get(rotation_id=rotation_id), None
    return reached, next_pass_in(reached)


RETRIED_PASSES = 5  # after that, the beat's pass (MIRBAD_CERT_CHECK_SECONDS) retries


def next_pass_in(rotation: CertRotation, now: dt.datetime | None = None) -> float | None:
    """Seconds until a rotation left open is worth driving again: the rest of the pin
    grace, or 30 s doubling after a failed step (the first RETRIED_PASSES)."""
    if not rotation.open:
        return None
    cfg = config()
    moment = now or timezone.now()
    if rotation.stage == Stage.CERT_ISSUED:
        ready = rotation.updated_at + dt.timedelta(seconds=cfg.rotation_pin_grace_seconds)
        if moment < ready:
            return (ready - moment).total_seconds() + 0.1
    if 0 < rotation.attempts <= RETRIED_PASSES:
        return min(30.0 * 2 ** (rotation.attempts - 1), cfg.cert_check_seconds)
    return None


def _pass(rotation_id: str, *, steps: int) -> CertRotation | None:
    if not _take_lease(rotation_id):
        return None
    try:
        for _ in range(steps):
            _renew_lease(rotation_id)
            rotation = CertRotation.objects.select_related("node").get(rotation_id=rotation_id)
            if not rotation.open:
                return rotation
            try:
                if not _step(rotation):
                    return rotation
            except (AgentError, RotationFailed, pki.PkiError) as exc:
                rotation.attempts += 1
                rotation.last_error = str(exc)[:500]
                rotation.save(update_fields=["attempts", "last_error", "updated_at"])
                _renewal_failed(rotation, rotation.last_error)
                log.warning("Certificate rotation %s of node %s at %s: %s", rotation_id,
                            rotation.node.node_id, rotation.stage, exc)  # fmt: skip
                return rotation
        return CertRotation.objects.select_related("node").get(rotation_id=rotation_id)
    finally:
        CertRotation.objects.filter(rotation_id=rotation_id).update(lease_until=None)


def _renewal_failed(rotation: CertRotation, error: str) -> None:
    """Keep the error on the node: certificate_expiring shows it (the monitor reloads)."""
    changed = (
        Node.objects.filter(pk=rotation.node_id)
        .exclude(cert_renewal_error=error)
        .update(cert_renewal_error=error)
    )
    audit.record("rotation.failed", node_id=rotation.node.node_id, subject=rotation.rotation_id,
                 stage=rotation.stage, error=error[:300])  # fmt: skip
    if changed:
        events.tell_monitor(rotation.node.node_id)
    _announce(rotation.node_id)  # the attempt count and the error


def _step(rotation: CertRotation) -> bool:
    """One step from the rotation's stage; False when it must wait for a later pass."""
    stage = rotation.stage
    if stage == Stage.REQUESTED:
        _start(rotation)
    elif stage == Stage.CSR_RECEIVED:
        _issue(rotation)
    elif stage == Stage.CERT_ISSUED:
        grace = dt.timedelta(seconds=config().rotation_pin_grace_seconds)
        if timezone.now() < rotation.updated_at + grace:
            return False  # routers and the monitor learn the pending pin first
        _install(rotation)
    elif stage == Stage.CERT_INSTALLED:
        _prove_and_commit(rotation)
    elif stage == Stage.COMMITTING:
        _prove_and_commit(rotation)
    elif stage == Stage.COMMITTED:
        _promote(rotation)
    return True


def _start(rotation: CertRotation) -> None:
    with AgentClient(node=rotation.node) as client:
        try:
            answer = client.rotation_start(rotation.rotation_id)
        except AgentRefused as exc:
            other = exc.details.get("activeRotationId")
            if exc.code == "invalid_state" and other and other != rotation.rotation_id:
                # A rotation the master has no record of (its record lost): abort it.
                log.warning("Node %s has rotation %s open that the master never recorded; "
                            "aborting it", rotation.node.node_id, other)  # fmt: skip
                client.rotation_abort(other)
                answer = client.rotation_start(rotation.rotation_id)
            elif exc.code == "invalid_state":
                _finish_aborted(rotation, f"the agent had ended it: {exc.message}")
                raise RotationFailed(exc.message) from None
            else:
                raise
    if answer.get("stage") != "KeyGenerated":
        _follow(rotation, answer)
        return
    csr_pem = str(answer.get("csrPem") or "")
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except ValueError as exc:
        raise RotationFailed(f"the agent's CSR cannot be read: {exc}") from None
    _set(rotation, Stage.CSR_RECEIVED, csr_pem=csr_pem,
         pending_spki=key_spki_sha256(csr.public_key()))  # fmt: skip


def _issue(rotation: CertRotation) -> None:
    cfg = config()
    cert = pki.issue_node_certificate(
        master_pki().ca,
        csr_pem=rotation.csr_pem,
        node_id=rotation.node.node_id,
        lifetime=dt.timedelta(seconds=cfg.node_cert_seconds),
    )
    spki = pki.spki_sha256(cert)
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=rotation.node_id)
        node.pending_pin = spki  # the master's connections accept either pin from now
        node.save()
        _set(
            rotation, Stage.CERT_ISSUED,
            cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
            cert_serial=format(cert.serial_number, "x"),
            cert_not_after=cert.not_valid_after_utc,
            pending_spki=spki,
        )  # fmt: skip
        events.tell_monitor(node.node_id)


def _install(rotation: CertRotation) -> None:
    with AgentClient(node=rotation.node) as client:
        try:
            answer = client.rotation_install(rotation.rotation_id, rotation.cert_pem)
        except AgentRefused as exc:
            if exc.code == "invalid_state":
                _follow(rotation, client.rotation(rotation.rotation_id))
                return
            if exc.code == "not_found":
                _follow(rotation, {"stage": None})  # the agent lost it: start again
                return
            raise
    if answer.get("stage") == "CertInstalled":
        _set(rotation, Stage.CERT_INSTALLED)
    else:
        _follow(rotation, answer)


def _proof_client(rotation: CertRotation) -> httpx.Client:
    """A client that can reach the node only if it presents the new certificate: a
    context of its own (never cached, so no pooled connection and no resumed session)
    pinned to the pending key alone."""
    mp = master_pki()
    context = pki.agent_client_context(
        ca=mp.ca.cert,
        ca_path=mp.ca.cert_path,
        client_chain=mp.client.path,
        node_id=rotation.node.node_id,
        pins=[rotation.pending_spki],
    )
    return httpx.Client(
        base_url=agent_url(rotation.node), verify=context, timeout=15.0,
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
    )  # fmt: skip


def _prove_and_commit(rotation: CertRotation) -> None:
    with AgentClient(node=rotation.node) as fenced, _proof_client(rotation) as proof:
        try:
            seen = check_answer(proof.get(f"/pki/rotations/{rotation.rotation_id}"))
        except httpx.HTTPError as exc:
            raise RotationFailed(
                f"the proof connection to the new certificate failed: {exc}"
            ) from None
        stage = seen.get("stage")
        if stage == "Committed":
            _set(rotation, Stage.COMMITTED)  # a lost commit answer: it happened
            return
        if stage != "CertInstalled":
            _follow(rotation, seen)
            return
        connection = seen.get("connection") or {}
        if connection.get("presentedSpki") != rotation.pending_spki or connection.get(
            "sessionReused"
        ):
            raise RotationFailed(f"the proof connection did not show the new certificate: {seen}")
        if rotation.stage != Stage.COMMITTING:
            _set(rotation, Stage.COMMITTING)  # from here the rotation is never aborted
        try:
            # Recorded in the master's operation log and sent once, over the proof
            # connection; a lost answer is read back by the next pass (stage Committed).
            answer = fenced.rotation_commit(rotation.rotation_id, via=proof)
        except AgentUnreachable as exc:
            raise RotationFailed(f"the commit got no answer: {exc}") from None
    if answer.get("stage") != "Committed":
        raise RotationFailed(f"the agent answered the commit with {answer}")
    _set(rotation, Stage.COMMITTED)


def _promote(rotation: CertRotation) -> None:
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=rotation.node_id)
        node.spki_pin = rotation.pending_spki
        node.pending_pin = ""
        node.cert_serial = rotation.cert_serial
        node.cert_not_after = rotation.cert_not_after
        node.cert_renewal_error = ""
        node.save()  # the router retires connections under the old pin (D44)
        rotation.open = False
        rotation.finished_at = timezone.now()
        rotation.last_error = ""
        rotation.save()
        audit.record("rotation.committed", node_id=node.node_id, subject=rotation.rotation_id,
                     pin=rotation.pending_spki, serial=rotation.cert_serial)  # fmt: skip
        events.tell_monitor(node.node_id)
        _announce(node.pk)
    log.info("Certificate rotation %s of node %s: committed; the node's pin is %s",
             rotation.rotation_id, rotation.node.node_id, rotation.pending_spki)  # fmt: skip


def _follow(rotation: CertRotation, agent: dict[str, Any]) -> None:
    """The agent reports another stage than the record: follow it while that is safe."""
    stage = agent.get("stage")
    mine = rotation.stage
    if stage == "CertInstalled" and mine in (Stage.CERT_ISSUED, Stage.CERT_INSTALLED):
        _set(rotation, Stage.CERT_INSTALLED)  # the install's answer was lost
    elif stage == "Committed" and mine in (Stage.CERT_INSTALLED, Stage.COMMITTING):
        _set(rotation, Stage.COMMITTED)
    elif mine in (Stage.COMMITTING, Stage.COMMITTED):
        # Past the point of no return the master never aborts: it keeps both pins and
        # says so; the operator rekeys the node if the agent lost its rotation.
        raise RotationFailed(f"the agent reports {stage} for a committing rotation")
    else:
        _finish_aborted(rotation, f"the agent reports {stage}; a new rotation starts later")
        raise RotationFailed(f"the agent reports {stage}; the rotation was aborted")


def rotate_now(node_id: str, *, actor: str = "operator") -> CertRotation:
    """The operator's "rotate now": open a rotation and drive it in Celery at once."""
    rotation = request_rotation(node_id, reason=CertRotation.Reason.OPERATOR, actor=actor)
    from nodes.tasks import drive_rotation  # the tasks import this module

    rotation_id = rotation.rotation_id
    transaction.on_commit(lambda: drive_rotation.delay(rotation_id))
    return rotation


def check_certificates(now: dt.datetime | None = None) -> dict[str, int]:
    """Celery beat's pass: open the renewals that are due, then drive every open
    rotation a step further (which is also how one resumes after a master crash)."""
    started = 0
    for node in due_for_renewal(now):
        try:
            request_rotation(node.node_id, reason=CertRotation.Reason.SCHEDULED, actor="beat")
            started += 1
        except ServiceError as exc:
            log.warning("Node %s is due for a new certificate but cannot rotate: %s",
                        node.node_id, exc)  # fmt: skip
    driven = 0
    for rotation_id in CertRotation.objects.filter(open=True).values_list("rotation_id", flat=True):
        advance(rotation_id)
        driven += 1
    return {"started": started, "driven": driven}
