"""The node registry: who the agents are and how the master may trust them."""

from __future__ import annotations

import datetime

from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from protocol.names import NODE_ID_PATTERN

node_id_validator = RegexValidator(
    NODE_ID_PATTERN,
    "Use lower-case letters, digits and '-', starting with a letter or digit (max 40).",
)


DEFAULT_GPU_RESERVE_BYTES = 1024**3


class Node(models.Model):
    """One machine running an agent.

    The live state (Online, Offline, ...) is not stored here: the monitor keeps
    it in the Redis status cache, because it changes every few seconds and every
    web process must read the same value. This row holds what must survive a
    restart: identity, pin, approval, address.
    """

    node_id = models.CharField(max_length=40, unique=True, validators=[node_id_validator])
    display_name = models.CharField(max_length=100, blank=True)
    address = models.URLField(help_text="The agent URL the master dials, https://host:port")
    is_bootstrap = models.BooleanField(default=False)
    approved = models.BooleanField(default=False)
    revoked = models.BooleanField(default=False)
    draining = models.BooleanField(default=False)
    # A maintenance hold (a benchmark or tuning job, or an operator): /v1 sends no
    # traffic to the node's replicas until it ends, and answers 503 maintenance.
    maintenance_until = models.DateTimeField(null=True, blank=True)
    maintenance_reason = models.CharField(max_length=200, blank=True)
    spki_pin = models.CharField(max_length=64, blank=True, help_text="Base64 SHA-256 of the SPKI")
    pending_pin = models.CharField(max_length=64, blank=True)
    cert_serial = models.CharField(max_length=64, blank=True)
    cert_not_after = models.DateTimeField(null=True, blank=True)
    # Why the last renewal of the certificate failed (nodes/rotation.py); empty once one
    # commits. Shown with certificate_expiring.
    cert_renewal_error = models.CharField(max_length=500, blank=True)
    enrolled_at = models.DateTimeField(null=True, blank=True)
    agent_version = models.CharField(max_length=40, blank=True)
    protocol_version = models.PositiveSmallIntegerField(null=True, blank=True)
    os = models.CharField(max_length=40, blank=True)
    arch = models.CharField(max_length=40, blank=True)
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    facts = models.JSONField(
        default=dict, blank=True, help_text="The agent's self-description from /info"
    )
    # Admission keeps this much memory free for everything that is not a model:
    # host RAM on CPU and unified-memory nodes, and per GPU (by UUID) on discrete
    # GPUs. A GPU absent from ``gpu_reserves`` gets DEFAULT_GPU_RESERVE_BYTES.
    memory_reserve_bytes = models.BigIntegerField(default=2 * 1024**3)
    gpu_reserves = models.JSONField(default=dict, blank=True)
    # The operator's key=value tags, checked by nodes/labels.py (PATCH /api/nodes/{id}).
    labels = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node_id"]

    def __str__(self) -> str:
        return self.node_id

    @property
    def pins(self) -> list[str]:
        return [p for p in (self.spki_pin, self.pending_pin) if p]

    @property
    def enrolled(self) -> bool:
        return bool(self.spki_pin or self.pending_pin)

    def maintenance_left(self, now: datetime.datetime | None = None) -> float:
        """Seconds left of the maintenance hold, 0 when there is none (or it ran out)."""
        if self.maintenance_until is None:
            return 0.0
        left = (self.maintenance_until - (now or timezone.now())).total_seconds()
        return left if left > 0 else 0.0

    def gpu_reserve(self, uuid: str) -> int:
        """The reserve admission keeps free on one GPU of this node."""
        value = (self.gpu_reserves or {}).get(uuid)
        return int(value) if isinstance(value, int) else DEFAULT_GPU_RESERVE_BYTES


class JoinToken(models.Model):
    """A single-use enrollment token, stored as its SHA-256 only."""

    class Purpose(models.TextChoices):
        BOOTSTRAP = "bootstrap"
        JOIN = "join"
        REKEY = "rekey"

    token_hash = models.CharField(max_length=64, unique=True)
    node_id = models.CharField(max_length=40, validators=[node_id_validator])
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.purpose} token for {self.node_id}"


class CertRotation(models.Model):
    """One two-phase renewal of a node's certificate, driven by the master
    (nodes/rotation.py; docs/operator-guide.md, "Certificates").

    Each stage is saved before the step it names, so a master that crashes resumes
    from the stored stage. At most one rotation is open per node (the constraint).
    """

    class Stage(models.TextChoices):
        REQUESTED = "Requested"
        CSR_RECEIVED = "CsrReceived"
        CERT_ISSUED = "CertIssued"
        CERT_INSTALLED = "CertInstalled"
        COMMITTING = "Committing"
        COMMITTED = "Committed"
        ABORTED = "Aborted"

    class Reason(models.TextChoices):
        SCHEDULED = "scheduled"
        OPERATOR = "operator"

    rotation_id = models.CharField(max_length=44, unique=True)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="rotations")
    stage = models.CharField(max_length=16, choices=Stage.choices, default=Stage.REQUESTED)
    open = models.BooleanField(default=True)
    reason = models.CharField(max_length=16, choices=Reason.choices)
    csr_pem = models.TextField(blank=True)
    pending_spki = models.CharField(max_length=64, blank=True)
    cert_pem = models.TextField(blank=True)
    cert_serial = models.CharField(max_length=64, blank=True)
    cert_not_after = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=500, blank=True)
    # A pass that holds the rotation (Celery runs two at once): others leave it alone.
    lease_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"], condition=models.Q(open=True), name="one_open_rotation_per_node"
            )
        ]

    def __str__(self) -> str:
        return f"{self.rotation_id} of {self.node_id} ({self.stage})"


class AuditEvent(models.Model):
    """One thing done to the fleet that an operator may need to account for later
    (nodes/audit.py writes them; the console's Audit page, /api/audit and the Django
    admin list them, read-only; kept ``MIRBAD_AUDIT_KEEP_DAYS``)."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=150)  # "system", a user name, "key mbd-AbC… (#3)"
    source = models.CharField(max_length=64, blank=True)  # the peer address, or "local"
    action = models.CharField(max_length=60)  # e.g. rotation.stage, rotation.committed
    node_id = models.CharField(max_length=40, blank=True, db_index=True)
    subject = models.CharField(max_length=60, blank=True)  # e.g. the rotation id
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.node_id}"


class MasterOperation(models.Model):
    """One mutation the master sent to an agent, written before it is sent
    (nodes/operations.py; docs/operator-guide.md, "Operations the master sends").

    The id travels as ``MirbadLLM-Operation-Id``, so a request whose answer was lost can
    be sent again under the same id and the agent answers it from its own operation log
    instead of acting twice. A row stays ``open`` until an answer closes it, or until the
    monitor, on reaching the node, closes it from the agent's record (``reconciled``).
    ``summary`` is short and redacted: a download's Hugging Face token never lands here.
    """

    class Kind(models.TextChoices):
        LAUNCH = "launch"
        STOP = "stop"
        DELETE = "delete"
        DOWNLOAD = "download"
        CANCEL_DOWNLOAD = "cancel_download"
        RECLAIM = "reclaim"
        ROTATION_START = "rotation_start"
        ROTATION_INSTALL = "rotation_install"
        ROTATION_COMMIT = "rotation_commit"
        ROTATION_ABORT = "rotation_abort"

    class State(models.TextChoices):
        OPEN = "open"
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    operation_id = models.CharField(max_length=80, unique=True)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="operations")
    kind = models.CharField(max_length=20, choices=Kind.choices)
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=300)
    # The instance id, folder or rotation id the operation is about.
    target = models.CharField(max_length=200, blank=True)
    state = models.CharField(max_length=12, choices=State.choices, default=State.OPEN)
    # Closed by the monitor from the agent's record, not by the answer itself.
    reconciled = models.BooleanField(default=False)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    summary = models.CharField(max_length=500, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    opened_at = models.DateTimeField(default=timezone.now)
    # Until then the sender may still be waiting for an answer: the monitor leaves the
    # row alone (it would call a request still on its way "never reached").
    sender_deadline = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at", "-id"]
        indexes = [models.Index(fields=["node", "state"], name="master_op_node_state")]

    def __str__(self) -> str:
        return f"{self.kind} {self.target} on {self.node_id} ({self.state})"


class MasterCredential(models.Model):
    """One of the master's own key pairs, shared by every master host (docs/decisions.md D80).

    ``name`` is ``ca`` (the internal CA), ``master-client`` (what the master presents to
    agents) or ``enroll`` (the enroll listener's server certificate). The private key is
    kept only sealed with the master key (AES-256-GCM, ``nodes/master_store.py``): a copy
    of the database alone does not give the CA away. Each host writes the TLS files
    Python's ``ssl`` needs from these rows into ``DATA_PATH/pki`` as caches.
    """

    name = models.CharField(max_length=40, primary_key=True)
    cert_pem = models.TextField()
    sealed_key = models.TextField(help_text="v1.<base64 of nonce + AES-256-GCM ciphertext>")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.name


class MasterState(models.Model):
    """The master's fencing identity, one row (pk 1): read by every process on every
    master host, raised in one transaction at each monitor start (docs/decisions.md D81).
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    instance_id = models.CharField(max_length=64)
    epoch = models.BigIntegerField(default=0)
    boot_id = models.CharField(max_length=64)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.instance_id}/{self.epoch}/{self.boot_id}"
