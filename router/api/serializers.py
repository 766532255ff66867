"""/api/keys and /api/usage on the wire."""

from __future__ import annotations

from typing import Any

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError

from core.api_serializers import ApiSerializer, IsoDateTime, JsonInt, JsonStr, JsonStrList
from router import budgets
from router.models import ApiKey


class KeyWriteSerializer(ApiSerializer):
    """POST /api/keys and PATCH /api/keys/{id}; ``source`` is router.keys' name.

    The types router.keys cannot judge (a JSON list, an ISO 8601 text) are checked
    here; the rules (scopes, limits, a future expiry) are router.keys'.
    """

    name = JsonStr(help_text="1-100 characters.")
    scopes = JsonStrList(help_text="chat, completions, embeddings, rerank, admin.")
    models = JsonStrList(source="model_allowlist", help_text="Served names; empty for any.")
    expiresAt = JsonStr(source="expires_at", help_text="An ISO 8601 time with a zone, or null.")
    rpmLimit = JsonInt(source="rpm_limit", help_text="Requests per minute, or null.")
    tpmLimit = JsonInt(source="tpm_limit", help_text="Tokens per minute, or null.")
    concurrencyLimit = JsonInt(source="concurrency_limit", help_text="In flight, or null.")
    priority = JsonInt(help_text="Queue priority -1000..1000; higher first (default 0).")
    queueTimeoutSeconds = JsonInt(
        source="queue_timeout_seconds", help_text="Longest queue wait 1-86400 s, or null."
    )
    dailyTokenBudget = JsonInt(source="daily_token_budget", help_text="Tokens a day, or null.")
    monthlyTokenBudget = JsonInt(
        source="monthly_token_budget", help_text="Tokens a month, or null."
    )
    budgetTimezone = JsonStr(
        source="budget_timezone", help_text="IANA zone of the budgets' day and month (UTC)."
    )

    def validate_scopes(self, value: Any) -> Any:
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValidationError("must be a list of strings.")
        return value

    def validate_expiresAt(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            expires = parse_datetime(str(value))
        except ValueError:  # well-formed but impossible, e.g. month 13
            expires = None
        if expires is None or expires.tzinfo is None:
            raise ValidationError("use an ISO 8601 time with a zone.")
        return expires

    @classmethod
    def api_name(cls, source: str) -> str:
        """The API's name of a service field (``model_allowlist`` is ``models``)."""
        for name, field in cls().fields.items():
            if (field.source or name) == source:
                return name
        return source


class BudgetPeriodSerializer(serializers.Serializer[dict[str, Any]]):
    limit = serializers.IntegerField(help_text="Tokens in the period.")
    used = serializers.IntegerField(help_text="Tokens used so far (metered, all processes).")
    resetsAt = IsoDateTime(help_text="The start of the next period.")


class BudgetSerializer(serializers.Serializer[dict[str, Any]]):
    """A key's budgets now (router.budgets.status)."""

    day = BudgetPeriodSerializer(allow_null=True)
    month = BudgetPeriodSerializer(allow_null=True)
    warning = serializers.CharField(
        allow_null=True, help_text="From 80 % of a budget on; null below."
    )


class KeySerializer(serializers.Serializer[ApiKey]):
    """An API key as listed; the key itself is shown only once, at creation.

    ``budget`` is read from ``context["budgets"]`` (router.budgets.status of every
    listed key at once) when the view gives it, else for this key alone.
    """

    id = serializers.IntegerField(source="pk")
    name = serializers.CharField()
    prefix = serializers.CharField()
    scopes = serializers.ListField(child=serializers.CharField())
    models = serializers.ListField(child=serializers.CharField(), source="model_allowlist")
    expiresAt = IsoDateTime(source="expires_at", allow_null=True)
    revokedAt = IsoDateTime(source="revoked_at", allow_null=True)
    createdAt = IsoDateTime(source="created_at")
    lastUsedAt = IsoDateTime(source="last_used_at", allow_null=True)
    rpmLimit = serializers.IntegerField(source="rpm_limit", allow_null=True)
    tpmLimit = serializers.IntegerField(source="tpm_limit", allow_null=True)
    concurrencyLimit = serializers.IntegerField(source="concurrency_limit", allow_null=True)
    priority = serializers.IntegerField()
    queueTimeoutSeconds = serializers.IntegerField(source="queue_timeout_seconds", allow_null=True)
    dailyTokenBudget = serializers.IntegerField(source="daily_token_budget", allow_null=True)
    monthlyTokenBudget = serializers.IntegerField(source="monthly_token_budget", allow_null=True)
    budgetTimezone = serializers.CharField(source="budget_timezone")
    budget = serializers.SerializerMethodField()

    @extend_schema_field(BudgetSerializer(allow_null=True))
    def get_budget(self, row: ApiKey) -> dict[str, Any] | None:
        known = self.context.get("budgets")
        found = known.get(row.pk) if known is not None else budgets.status([row]).get(row.pk)
        return BudgetSerializer(found).data if found is not None else None


class NewKeySerializer(KeySerializer):
    key = serializers.CharField(help_text="The key itself: shown this once, stored hashed.")


# many=False: the list action answers one object that holds the list, not a bare array.
@extend_schema_serializer(many=False)
class KeyListSerializer(serializers.Serializer[dict[str, Any]]):
    keys = KeySerializer(many=True)


def _with_errors(
    fields: dict[str, serializers.Field[Any, Any, Any, Any]],
) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
    # "errors" cannot be a declared field: Serializer.errors is the validation errors.
    fields["errors"] = serializers.IntegerField(
        help_text="Requests answered with 400 or more, or cut by an error inside a stream"
    )
    return fields


class UsageRowSerializer(serializers.Serializer[dict[str, Any]]):
    """One key and model's sums over the range (router.usage.usage_summary's row)."""

    keyId = serializers.IntegerField(source="key_id", allow_null=True)
    keyPrefix = serializers.CharField(source="key_prefix")
    keyName = serializers.CharField(source="key_name", allow_null=True)
    model = serializers.CharField()
    requests = serializers.IntegerField()
    promptTokens = serializers.IntegerField(source="prompt_tokens")
    completionTokens = serializers.IntegerField(source="completion_tokens")
    totalTokens = serializers.SerializerMethodField()

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        return _with_errors(super().get_fields())

    def get_totalTokens(self, row: dict[str, Any]) -> int:
        return int(row["prompt_tokens"] + row["completion_tokens"])


def usage_items(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``UsageRowSerializer(rows, many=True).data``, the same keys in the same order,
    written out: a month has a row per key and model (thousands), and the field
    machinery cost about 70 us a row (bench/usage.py)."""
    out = []
    for row in rows:
        prompt, completion = int(row["prompt_tokens"]), int(row["completion_tokens"])
        out.append(
            {
                "keyId": row["key_id"],
                "keyPrefix": str(row["key_prefix"]),
                "keyName": None if row["key_name"] is None else str(row["key_name"]),
                "model": str(row["model"]),
                "requests": int(row["requests"]),
                "promptTokens": prompt,
                "completionTokens": completion,
                "totalTokens": prompt + completion,
                "errors": int(row["errors"]),
            }
        )
    return out


class UsageTotalsSerializer(serializers.Serializer[dict[str, Any]]):
    requests = serializers.IntegerField()
    promptTokens = serializers.IntegerField()
    completionTokens = serializers.IntegerField()
    totalTokens = serializers.IntegerField()

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        return _with_errors(super().get_fields())


class UsageSummarySerializer(serializers.Serializer[dict[str, Any]]):
    # "from" is a keyword: the field is declared in get_fields.
    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        return {
            "from": serializers.CharField(help_text="The range's start (ISO 8601)."),
            "to": serializers.CharField(help_text="The range's end (ISO 8601)."),
            "usage": UsageRowSerializer(many=True),
            "totals": UsageTotalsSerializer(),
        }
