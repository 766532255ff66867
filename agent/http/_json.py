"""Reading a JSON request body on the control API (one rule for every route)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from agent._errors import InvalidRequest

__all__ = ["read_json"]


async def read_json(request: web.Request) -> Any:
    """The body as JSON; 400 invalid_request naming the problem when it is not."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
