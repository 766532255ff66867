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
