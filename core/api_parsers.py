"""/api's JSON parser: DRF's, with a 400 for what json.loads alone lets through as a 500.

DRF's parser turns only ``ValueError`` into a 400. 100,000 nested brackets raise
``RecursionError``, and a lone surrogate escape (``"\\ud800"``) parses into a str that
the database cannot encode, so the save raised ``UnicodeEncodeError``. Both are
refused here, naming the field (core.jsoninput holds the rules /v1 shares).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework import parsers

from core.errors import ServiceError
from core.jsoninput import NOT_TEXT, first_non_text, why_not_json


class JSONParser(parsers.JSONParser):
    def parse(
        self,
        stream: Any,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        # A ServiceError, like the services' own refusals: the message starts with the
        # field and details name it (DRF's ParseError would read "detail: ...").
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError as exc:
            raise ServiceError(
                400, "invalid_request", f"body: not JSON: {why_not_json(exc)}",
                details={"field": "body"},
            ) from None  # fmt: skip
        bad = first_non_text(data)
        if bad is not None:
            raise ServiceError(
                400,
                "invalid_request",
                f"{bad}: {NOT_TEXT}",
                details={"field": bad},
            )
        return data
