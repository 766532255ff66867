"""API key creation, changes and lookup (shared by /v1, /api and the console)."""

from __future__ import annotations

import datetime
import hashlib
import secrets
import time
import zoneinfo
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from nodes import audit
from router.models import LIMIT_FIELDS, SCOPES, ApiKey

KEY_PREFIX = "mbd-"
# The fair queue's and the budgets' fields of a key (router.queue, router.budgets).
QUEUE_FIELDS = ("priority", "queue_timeout_seconds")
BUDGET_FIELDS = ("daily_token_budget", "monthly_token_budget", "budget_timezone")
# What PATCH may change. Scopes are not among them (docs/decisions.md D22).
EDITABLE_FIELDS = (
    "name", "model_allowlist", "expires_at", *LIMIT_FIELDS, *QUEUE_FIELDS, *BUDGET_FIELDS,
)  # fmt: skip
PRIORITY_RANGE = (-1000, 1000)
QUEUE_TIMEOUT_MAX = 86_400
BUDGET_MAX = 2**63 - 1  # PositiveBigIntegerField


class KeyError_(ValueError):
    """A key request is invalid; the message starts with the field's name."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class KeyNotFound(LookupError):
    """No key row has that id."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def validate_limit(field: str, value: object) -> int | None:
    """A limit is a positive whole number, or None for no limit."""
    if value is None:
        return None
    # bool is an int subclass: true must not mean "1 request per minute".
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31 - 1:
        raise KeyError_(field, "must be a positive whole number, or null for no limit")
    return value


# bool is an int subclass below: true must not mean 1.
def validate_priority(value: object) -> int:
    """The queue priority: a whole number in PRIORITY_RANGE (None: the default, 0)."""
    if value is None:
        return 0
    low, high = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise KeyError_("priority", f"must be a whole number from {low} to {high} (default 0)")
    return value


def validate_queue_timeout(value: object) -> int | None:
    """The longest wait in a queue in seconds, 1-86400, or None for the model's."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= QUEUE_TIMEOUT_MAX:
        raise KeyError_(
            "queue_timeout_seconds",
            f"must be a whole number of seconds from 1 to {QUEUE_TIMEOUT_MAX}, "
            "or null for the model's",
        )
    return value


def validate_budget(field: str, value: object) -> int | None:
    """A token budget is a positive whole number of tokens, or None for no budget."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= BUDGET_MAX:
        raise KeyError_(field, "must be a positive whole number of tokens, or null for no budget")
    return value


def validate_timezone(value: object) -> str:
    """An IANA time zone name such as ``Europe/Berlin`` (None: UTC)."""
    if value is None:
        return "UTC"
    if isinstance(value, str) and value.strip():
        name = value.strip()
        try:
            zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
            pass
        else:
            return name
    raise KeyError_(
        "budget_timezone",
        f"{value!r} is not an IANA time zone; use a name such as UTC, Europe/Berlin "
        "or America/New_York",
    )


_VALIDATORS = {
    "priority": validate_priority,
    "queue_timeout_seconds": validate_queue_timeout,
    "budget_timezone": validate_timezone,
}


def _validate_name(name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name.strip()) <= 100:
        raise KeyError_("name", "give a name of 1-100 characters")
    return name.strip()


def _validate_allowlist(models: object) -> list[str]:
    if models is None:
        return []
    if not isinstance(models, list | tuple) or not all(isinstance(m, str) for m in models):
        raise KeyError_("model_allowlist", "must be a list of served names")
    return sorted({m.strip() for m in models if m.strip()})


def _validate_expiry(expires_at: object) -> datetime.datetime | None:
    if expires_at is None:
        return None
    if not isinstance(expires_at, datetime.datetime) or timezone.is_naive(expires_at):
        raise KeyError_("expires_at", "must be a time with a zone")
    # A key born expired is a typo (a wrong year, local time read as UTC), never intent:
    # say so rather than hand out a key that fails its first request with 401.
    if expires_at <= timezone.now():
        raise KeyError_(
            "expires_at",
            f"{expires_at.isoformat()} is in the past; give a future time, or none for no expiry",
        )
    return expires_at


def create_key(
    *,
    name: str,
    scopes: list[str],
    model_allowlist: list[str] | None = None,
    expires_at: datetime.datetime | None = None,
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    concurrency_limit: int | None = None,
    priority: int | None = None,
    queue_timeout_seconds: int | None = None,
    daily_token_budget: int | None = None,
    monthly_token_budget: int | None = None,
    budget_timezone: str | None = None,
) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the plaintext key, which is never stored."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise KeyError_("scopes", f"unknown scope(s) {', '.join(unknown)}; use {', '.join(SCOPES)}")
    if not scopes:
        raise KeyError_("scopes", "give at least one scope")
    fields: dict[str, Any] = {
        "name": _validate_name(name),
        "model_allowlist": _validate_allowlist(model_allowlist),
        "expires_at": _validate_expiry(expires_at),
        "rpm_limit": validate_limit("rpm_limit", rpm_limit),
        "tpm_limit": validate_limit("tpm_limit", tpm_limit),
        "concurrency_limit": validate_limit("concurrency_limit", concurrency_limit),
        "priority": validate_priority(priority),
        "queue_timeout_seconds": validate_queue_timeout(queue_timeout_seconds),
        "daily_token_budget": validate_budget("daily_token_budget", daily_token_budget),
        "monthly_token_budget": validate_budget("monthly_token_budget", monthly_token_budget),
        "budget_timezone": validate_timezone(budget_timezone),
    }
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey.objects.create(
        prefix=key[: len(KEY_PREFIX) + 6],
        key_hash=hash_key(key),
        scopes=sorted(set(scopes)),
        **fields,
    )
    # The key itself is returned once and never stored, here least of all.
    audit.record("apikey.created", subject=row.prefix, keyId=row.pk, name=row.name,
                 scopes=row.scopes)  # fmt: skip
    return row, key


def update_key(key_id: int, changes: dict[str, Any]) -> ApiKey:
    """Change a key's name, allowlist, expiry, limits, queue fields or budgets (a None
    limit or budget removes it).

    Saved with ``save()`` so that post_save announces it to every router's key
    cache (router.signals); their TTL bounds a lost announcement.
    """
    row = get_key(key_id)
    cleaned = clean_changes(row, changes)
    for field, value in cleaned.items():
        setattr(row, field, value)
    if cleaned:
        row.save(update_fields=list(cleaned))
    return row


def clean_changes(row: ApiKey, changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` to ``row`` checked and cleaned, nothing saved (``KeyError_`` names a field).

    ``update_key`` applies the result; the Django admin's change form checks with it
    first, so it refuses what PATCH /api/keys refuses (docs/decisions.md D60).
    """
    unknown = sorted(set(changes) - set(EDITABLE_FIELDS))
    if unknown:
        if unknown[0] == "scopes":
            raise KeyError_("scopes", "cannot change on an existing key; create a new key")
        raise KeyError_(unknown[0], f"unknown field; editable: {', '.join(EDITABLE_FIELDS)}")
    cleaned: dict[str, Any] = {}
    for field, value in changes.items():
        if field == "name":
            cleaned[field] = _validate_name(value)
        elif field == "model_allowlist":
            cleaned[field] = _validate_allowlist(value)
        elif field == "expires_at":
            # Sending back the key's own expiry (already past) changes nothing: allowed.
            unchanged = value is not None and value == row.expires_at
            cleaned[field] = value if unchanged else _validate_expiry(value)
        elif field in _VALIDATORS:
            cleaned[field] = _VALIDATORS[field](value)
        elif field in ("daily_token_budget", "monthly_token_budget"):
            cleaned[field] = validate_budget(field, value)
        else:
            cleaned[field] = validate_limit(field, value)
    return cleaned


def get_key(key_id: int) -> ApiKey:
    """The key row, or ``KeyNotFound``."""
    row = ApiKey.objects.filter(pk=key_id).first()
    if row is None:
        raise KeyNotFound(f"Key {key_id} does not exist.")
    return row


def revoke_key(key_id: int) -> ApiKey:
    """Revoke once; revoking again keeps the first time."""
    row = get_key(key_id)
    if row.revoked_at is None:
        row.revoked_at = timezone.now()
        # save(), not a queryset update: post_save tells every router to drop its cache.
        row.save(update_fields=["revoked_at"])
        audit.record("apikey.revoked", subject=row.prefix, keyId=row.pk, name=row.name)
    return row


@dataclass(frozen=True)
class KeyInfo:
    """What /v1 needs of a key per request; cached per process."""

    id: int
    prefix: str
    scopes: frozenset[str]
    model_allowlist: frozenset[str]
    expires_at: float | None
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    concurrency_limit: int | None = None
    priority: int = 0  # the fair queue's order (router.queue)
    queue_timeout: float | None = None  # the longest wait in a queue; None: the model's
    daily_token_budget: int | None = None  # tokens per calendar day (router.budgets)
    monthly_token_budget: int | None = None
    budget_timezone: str = "UTC"  # the IANA zone of the budgets' day and month

    def allows_model(self, served_name: str) -> bool:
        return not self.model_allowlist or served_name in self.model_allowlist

    @property
    def limited(self) -> bool:
        """Whether the limiter has anything to count for this key."""
        return bool(self.rpm_limit or self.tpm_limit or self.concurrency_limit)

    @property
    def budgeted(self) -> bool:
        """Whether router.budgets has anything to count for this key."""
        return self.daily_token_budget is not None or self.monthly_token_budget is not None


def lookup(key: str) -> KeyInfo | None:
    """The usable key for ``key``, or None (unknown, revoked, expired)."""
    row = ApiKey.objects.filter(key_hash=hash_key(key)).first()
    if row is None or not row.usable():
        return None
    return KeyInfo(
        id=row.pk,
        prefix=row.prefix,
        scopes=frozenset(row.scopes),
        model_allowlist=frozenset(row.model_allowlist),
        expires_at=row.expires_at.timestamp() if row.expires_at else None,
        rpm_limit=row.rpm_limit,
        tpm_limit=row.tpm_limit,
        concurrency_limit=row.concurrency_limit,
        priority=row.priority,
        queue_timeout=row.queue_timeout_seconds,
        daily_token_budget=row.daily_token_budget,
        monthly_token_budget=row.monthly_token_budget,
        budget_timezone=row.budget_timezone,
    )


def still_valid(info: KeyInfo) -> bool:
    return info.expires_at is None or info.expires_at > time.time()
