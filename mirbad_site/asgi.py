"""The master's ASGI entry point.

``/v1`` goes to the lean router app (no Django middleware on the hot path),
``/ws/`` to Channels, everything else to Django (console, /api, admin, static).
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")

from django.core.asgi import get_asgi_application

django_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import path  # noqa: E402

from console.consumers import FleetConsumer, NodeConsumer  # noqa: E402
from console.log_consumer import LogConsumer  # noqa: E402
from router.app import RouterApp, Scope  # noqa: E402
from router.relay import Receive, Send  # noqa: E402

router_app = RouterApp()
# The console's and the API docs' static files come from the apps' static/ folders.
http_app = ASGIStaticFilesHandler(django_app)


async def http_dispatch(scope: Scope, receive: Receive, send: Send) -> None:
    path_ = scope.get("path", "")
    if path_ == "/v1" or path_.startswith("/v1/") or path_ == "/metrics":
        await router_app(scope, receive, send)
    else:
        # django-stubs wants a send that takes any Mapping; the server's takes the
        # dicts Django sends, which is all the ASGI spec lets it pass.
        await http_app(scope, receive, send)  # type: ignore[arg-type]  # see above


websocket_app = AllowedHostsOriginValidator(
    AuthMiddlewareStack(
        URLRouter(
            [
                path("ws/fleet/", FleetConsumer.as_asgi()),
                path("ws/nodes/<str:node_id>/", NodeConsumer.as_asgi()),
                path("ws/nodes/<str:node_id>/logs/<str:name>/", LogConsumer.as_asgi()),
            ]
        )
    )
)


class _Dispatch:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await http_dispatch(scope, receive, send)
        elif kind == "websocket":
            await websocket_app(scope, receive, send)
        elif kind == "lifespan":
            await router_app(scope, receive, send)


application = _Dispatch()

# What is loaded by now (Django, the apps, the URL and template machinery) lives as long
# as the process: moved out of the collector's reach, a gen-2 pass no longer scans it in
# the middle of a page of 500 models (bench/console_pages.py, docs/performance.md).
gc.collect()
gc.freeze()
# A fleet page allocates a few hundred thousand objects (1,000 nodes' records, 5,000
# models): at the default threshold (700) each render ran several full collections of
# 17-20 ms. A young collection every 50,000 allocations, an older one every 20 of those:
# the Overview at 1,000 nodes went from 83-91 to 61 ms in-process (docs/performance.md).
gc.set_threshold(50_000, 20, 10)
