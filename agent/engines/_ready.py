"""The Ready rule every runtime applies to its engines, written once.

An engine is Ready when ``GET /health`` answers 200 and ``GET /v1/models`` with the
instance's key lists the served name. The second check catches a foreign server
that took the port (it does not know the key or the name), and an engine that
answers /health before its model is loaded under the right name.
"""

from __future__ import annotations

from typing import Any

import aiohttp

__all__ = ["engine_ready", "listed_names"]


async def engine_ready(session: aiohttp.ClientSession, base: str, *, key: str, alias: str) -> bool:
    """True when the engine at ``base`` (``http://host:port``) is Ready under ``alias``."""
    try:
        async with session.get(base + "/health") as resp:
            if resp.status != 200:
                return False
        headers = {"Authorization": f"Bearer {key}"}
        async with session.get(base + "/v1/models", headers=headers) as resp:
            if resp.status != 200:
                return False
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    return alias in listed_names(body)


def listed_names(body: Any) -> set[str]:
    """The model names an OpenAI-style (``data[].id``) or llama.cpp (``models[]``) list holds."""
    names: set[str] = set()
    if not isinstance(body, dict):
        return names
    for item in body.get("data") or []:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            names.add(item["id"])
    for item in body.get("models") or []:
        if isinstance(item, dict):
            names.update(v for v in (item.get("name"), item.get("model")) if isinstance(v, str))
    return names
