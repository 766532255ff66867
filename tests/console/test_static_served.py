"""The web process serves the console's static files (its pages are blank without them)."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize(
    "path", ["/static/console/live.js", "/static/console/confirm.js", "/static/console/console.css"]
)
async def test_console_assets_are_served_by_the_asgi_app(path: str) -> None:
    from mirbad_site.asgi import http_app

    transport = httpx.ASGITransport(app=http_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.get(path)
    assert response.status_code == 200, f"{path}: {response.status_code}"
    assert len(response.content) > 0
