"""What every /api serializer shares: the body's shape, unknown fields, and JSON values.

A request serializer checks what a request must look like before a service sees it:
a JSON object, only the fields it knows (camelCase, as the API spells them), and the
types the views used to check by hand. The rules a value must meet beyond its shape
(ranges, names, what exists) stay in the services, which the console and the admin
share, so each refusal keeps one wording (docs/decisions.md D41).

Refusals are ``ValidationError``s keyed by the API's field name, so
``mirbad_site.api_errors`` answers ``{"error": {"code": "invalid_request",
"message": "<field>: ...", "fields": {...}}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.settings import api_settings

NOT_AN_OBJECT = "The body must be a JSON object."


def body_error(message: str) -> ValidationError:
    """A refusal of the whole body (no field to name); the message is the answer's."""
    return ValidationError({api_settings.NON_FIELD_ERRORS_KEY: [message]})


class ApiSerializer(serializers.Serializer):
    """A request body: a JSON object with known fields only.

    A body that is not an object is refused everywhere (the schema promises an
    object; tests/e2e/test_api_fuzz.py holds the API to it). ``ignore_unknown``
    keeps the endpoints that always ignored unknown fields as they were; the others
    refuse them.
    """

    ignore_unknown: ClassVar[bool] = False
    not_an_object: ClassVar[str] = NOT_AN_OBJECT

    def unknown_fields(self, unknown: list[str]) -> ValidationError:
        """The refusal of fields the endpoint does not know; the first one is named."""
        known = ", ".join(sorted(self.fields))
        return ValidationError({unknown[0]: f"unknown field; known fields are {known}"})

    def run_validation(self, data: Any = serializers.empty) -> Any:
        if data is None:  # a JSON null: DRF would say only "No data provided"
            raise body_error(self.not_an_object)
        return super().run_validation(data)

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, Mapping):
            raise body_error(self.not_an_object)
        unknown = sorted(set(data) - set(self.fields))
        if unknown and not self.ignore_unknown:
            raise self.unknown_fields(unknown)
        return super().to_internal_value(data)


def parse(serializer_class: type[ApiSerializer], data: Any) -> dict[str, Any]:
    """The validated body as service arguments (model field names where ``source`` says)."""
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


class JsonValue(serializers.Field):
    """A JSON value passed through unchanged; its service judges it.

    The subclasses only tell the schema what the service expects; the service's own
    refusal (naming the field) is the one the caller reads, as before serializers.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        kwargs.setdefault("allow_null", True)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Any:
        return data

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(OpenApiTypes.INT)
class JsonInt(JsonValue):
    pass


@extend_schema_field(OpenApiTypes.STR)
class JsonStr(JsonValue):
    pass


@extend_schema_field(OpenApiTypes.BOOL)
class JsonBool(JsonValue):
    pass


@extend_schema_field(OpenApiTypes.OBJECT)
class JsonObject(JsonValue):
    pass


@extend_schema_field({"type": "array", "items": {"type": "string"}})
class JsonStrList(JsonValue):
    pass


@extend_schema_field({"type": "array", "items": {"type": "object", "additionalProperties": {}}})
class JsonObjectList(JsonValue):
    pass


@extend_schema_field({"type": "object", "additionalProperties": {"type": "integer"}})
class JsonIntMap(JsonValue):
    pass


@extend_schema_field({"type": "object", "additionalProperties": {"type": "string"}})
class JsonStrMap(JsonValue):
    pass


@extend_schema_field(OpenApiTypes.DATETIME)
class IsoDateTime(serializers.Field):
    """An aware datetime as ``datetime.isoformat()`` writes it (``+00:00``, not ``Z``).

    DRF's ``DateTimeField`` would rewrite the zone and the offset; the API's answers
    keep the spelling they always had.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("read_only", True)
        super().__init__(**kwargs)

    def to_representation(self, value: Any) -> str:
        return str(value.isoformat())


class ErrorBodySerializer(serializers.Serializer):
    # Built in get_fields: a declared field called "fields" would hide Serializer.fields.
    def get_fields(self) -> dict[str, serializers.Field]:
        return {
            "code": serializers.CharField(
                help_text="A stable code: invalid_request, not_found, ..."
            ),
            "message": serializers.CharField(help_text="What was wrong, naming the field."),
            "details": serializers.DictField(required=False, help_text="Code-specific extras."),
            "fields": serializers.DictField(
                required=False, help_text="The refusal of each field (serializer refusals)."
            ),
        }


class ErrorSerializer(serializers.Serializer):
    """The shape of every /api error (mirbad_site.api_errors)."""

    error = ErrorBodySerializer()


# A whole-number query parameter: /api reads an empty one (``?limit=``, a form's empty
# field) as left out, so its schema admits "" beside the integer.
INT_OR_EMPTY: dict[str, Any] = {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 0}]}


def errors(*statuses: int) -> dict[int, type[serializers.Serializer]]:
    """Schema responses: each status answered with the ``{"error": {...}}`` shape."""
    return {status: ErrorSerializer for status in statuses}
