"""API keys for /v1 and /api, and the usage metered per key and model."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

SCOPES = ("chat", "completions", "embeddings", "rerank", "admin")
LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "concurrency_limit")


class ApiKey(models.Model):
    """A client key, stored as its SHA-256; the key itself is shown once at creation.

    The three limits are optional (null = unlimited) and are counted in Redis by
    ``router.limits.Limiter``, so they hold across every web process.
    """

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="The first characters, to recognise a key")
    key_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    model_allowlist = models.JSONField(default=list, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    rpm_limit = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Requests per minute"
    )
    tpm_limit = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Prompt + completion tokens per minute",
    )
    concurrency_limit = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Requests at once"
    )
    # The fair queue (router.queue): higher goes first; same priority is round robin.
    priority = models.IntegerField(default=0, help_text="Queue priority; higher is served first")
    queue_timeout_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Longest wait in a model's queue; null: the model's",
    )
    # Token budgets (router.budgets), per calendar day and month in budget_timezone.
    daily_token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Tokens per day"
    )
    monthly_token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Tokens per month"
    )
    budget_timezone = models.CharField(
        max_length=64, default="UTC", help_text="IANA zone of the budget's day and month"
    )

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}...)"

    def usable(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()


class UsageCounts(models.Model):
    """What every usage row counts: requests, tokens and errors of one key (by its
    prefix too, readable after the key row is deleted) on one served name, in the
    period its concrete table names (an hour, a day, a month).

    The key's foreign key is in each table: its reverse name differs per table.
    """

    key_prefix = models.CharField(max_length=16)
    model = models.CharField(max_length=200, help_text="The served name")
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0)

    class Meta:
        abstract = True


class UsageRecord(UsageCounts):
    """Requests and tokens of one key on one served name in one UTC hour.

    Written by ``router.usage.UsageMeter`` with atomic increments, so several
    web processes add into the same row. ``key_prefix`` stays readable after
    the key row is deleted (the foreign key is then null).
    """

    key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage"
    )
    hour = models.DateTimeField(help_text="Start of the UTC hour")
    # The shared column with the help text it has had since migration 0003; the rollups'
    # have none (0005), and adding one there would be a migration for a label.
    errors = models.PositiveBigIntegerField(
        default=0, help_text="Requests answered with an error (status >= 400 or a stream error)"
    )

    class Meta:
        ordering = ["hour", "id"]
        constraints = [
            models.UniqueConstraint(fields=["key", "model", "hour"], name="usage_key_model_hour")
        ]
        indexes = [models.Index(fields=["hour"], name="usage_hour")]

    def __str__(self) -> str:
        return f"{self.key_prefix} {self.model} {self.hour:%Y-%m-%d %H}h"


class UsageDay(UsageCounts):
    """Requests and tokens of one key on one served name in one UTC day.

    A rollup of ``UsageRecord``, added to by the same flush in the same transaction
    (router.usage.write_deltas), so the hourly rows may be pruned while the days stay.
    """

    key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_days"
    )
    day = models.DateField(help_text="The UTC day")

    class Meta:
        ordering = ["day", "id"]
        constraints = [
            models.UniqueConstraint(fields=["key", "model", "day"], name="usage_key_model_day")
        ]
        indexes = [models.Index(fields=["day"], name="usage_day")]

    def __str__(self) -> str:
        return f"{self.key_prefix} {self.model} {self.day:%Y-%m-%d}"


class UsageMonth(UsageCounts):
    """Requests and tokens of one key on one served name in one UTC month (its first day).

    A rollup of ``UsageRecord`` like ``UsageDay``, written by the same flush.
    """

    key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_months"
    )
    month = models.DateField(help_text="The first day of the UTC month")

    class Meta:
        ordering = ["month", "id"]
        constraints = [
            models.UniqueConstraint(fields=["key", "model", "month"], name="usage_key_model_month")
        ]
        indexes = [models.Index(fields=["month"], name="usage_month")]

    def __str__(self) -> str:
        return f"{self.key_prefix} {self.model} {self.month:%Y-%m}"
