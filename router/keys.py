"""API key creation and lookup (shared by /v1 and /api)."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from django.utils import timezone

from router.models import SCOPES, ApiKey

KEY_PREFIX = "mbd-"


class KeyError_(ValueError):
    """A key request is invalid; the message names the field."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(
    *,
    name: str,
    scopes: list[str],
    model_allowlist: list[str] | None = None,
    expires_at: object = None,
) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the plaintext key, which is never stored."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise KeyError_(f"scopes: unknown scope(s) {', '.join(unknown)}; use {', '.join(SCOPES)}")
    if not scopes:
        raise KeyError_("scopes: give at least one scope")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey.objects.create(
        name=name,
        prefix=key[: len(KEY_PREFIX) + 6],
        key_hash=hash_key(key),
        scopes=sorted(set(scopes)),
        model_allowlist=model_allowlist or [],
        expires_at=expires_at,
    )
    return row, key


@dataclass(frozen=True)
class KeyInfo:
    id: int
    prefix: str
    scopes: frozenset[str]
    model_allowlist: frozenset[str]
    expires_at: float | None

    def allows_model(self, served_name: str) -> bool:
        return not self.model_allowlist or served_name in self.model_allowlist


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
    )


def still_valid(info: KeyInfo) -> bool:
    return info.expires_at is None or info.expires_at > time.time()


def touch(key_id: int) -> None:
    ApiKey.objects.filter(pk=key_id).update(last_used_at=timezone.now())
