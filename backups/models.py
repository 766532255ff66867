"""Backup runs and the one-time links that hand an on-demand backup to its requester."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class BackupRun(models.Model):
    """One backup, scheduled or on demand: when it ran, what it wrote, how it ended.

    A scheduled run writes a file into ``MIRBAD_BACKUP_DIRECTORY``; an on-demand run
    keeps its bytes in a :class:`BackupDownload` until the link is used or expires.
    ``finished_at`` stays empty while the run is in progress, or for ever when the
    process running it was killed (the console shows it as interrupted).
    """

    class Kind(models.TextChoices):
        SCHEDULED = "scheduled"
        ON_DEMAND = "on_demand"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    actor = models.CharField(max_length=150, default="beat")
    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The local day a scheduled run belongs to: at most one succeeds per day.
    day = models.DateField(null=True, blank=True)
    file_name = models.CharField(max_length=200, blank=True)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    has_secrets = models.BooleanField(default=False)
    has_ca = models.BooleanField(default=False)
    models_count = models.PositiveIntegerField(default=0)
    nodes_count = models.PositiveIntegerField(default=0)
    pruned = models.PositiveIntegerField(default=0)
    error = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["day"],
                condition=models.Q(kind="scheduled", day__isnull=False),
                name="one_scheduled_backup_claim_per_day",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} backup {self.started_at:%Y-%m-%d %H:%M}"

    @property
    def succeeded(self) -> bool:
        return self.finished_at is not None and not self.error


class BackupDownload(models.Model):
    """An on-demand backup waiting for its one-time link (stored as its SHA-256).

    The bytes live in the shared database, not on one master host, so the link works
    behind a load balancer whichever host answers it. Used or expired rows are
    deleted: the backup may hold sealed secrets and is kept no longer than needed.
    """

    run = models.OneToOneField(BackupRun, on_delete=models.CASCADE, related_name="download")
    token_hash = models.CharField(max_length=64, unique=True)
    file_name = models.CharField(max_length=200)
    content = models.BinaryField()
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"download of {self.file_name}"


class RestoreJob(models.Model):
    """One restore from the console: the uploaded document, its preview, then its progress.

    ``previewed`` until the operator confirms (nothing is changed before), then
    ``running`` while :mod:`backups.fleet_restore` fetches missing folders and starts
    the auto-start models, then ``done``. The document is dropped once applied.
    """

    class State(models.TextChoices):
        PREVIEWED = "previewed"
        RUNNING = "running"
        DONE = "done"

    actor = models.CharField(max_length=150)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PREVIEWED)
    file_name = models.CharField(max_length=200, blank=True)
    document = models.BinaryField(blank=True)
    sealed = models.BooleanField(default=False)
    preview = models.JSONField(default=dict, blank=True)
    applied = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"restore {self.pk} ({self.state})"


class RestoreStep(models.Model):
    """One model on one node in a restore's fleet phase: its folder, then its start."""

    class Phase(models.TextChoices):
        QUEUED = "queued"
        PRESENT = "present"
        DOWNLOADING = "downloading"
        DOWNLOADED = "downloaded"
        MISSING = "missing"
        STARTING = "starting"
        STARTED = "started"
        STOPPED = "stopped"
        FAILED = "failed"

    job = models.ForeignKey(RestoreJob, on_delete=models.CASCADE, related_name="steps")
    node_id = models.CharField(max_length=40)
    served_name = models.CharField(max_length=200)
    model_id_ref = models.PositiveIntegerField(null=True, blank=True)
    folder = models.CharField(max_length=200)
    start = models.BooleanField(default=False, help_text="An auto-start model: started after")
    phase = models.CharField(max_length=16, choices=Phase.choices, default=Phase.QUEUED)
    note = models.CharField(max_length=500, blank=True)
    bytes_done = models.BigIntegerField(null=True, blank=True)
    bytes_total = models.BigIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node_id", "id"]

    def __str__(self) -> str:
        return f"{self.served_name} on {self.node_id}: {self.phase}"
