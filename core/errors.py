"""One error type for services, turned into ``{"error": {...}}`` by /api."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A refusal with an HTTP status and a stable code; the message says what to do."""

    def __init__(
        self, status: int, code: str, message: str, *, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}
