"""``manage.py enroll_listener``: serve POST /enroll over TLS until stopped."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from django.conf import settings
from django.core.management.base import BaseCommand

from nodes.enroll_listener import build_app, server_context


class Command(BaseCommand):
    help = "Serve the enroll listener (POST /enroll, GET /ca) on MIRBAD_ENROLL_PORT."

    def handle(self, *args: Any, **options: Any) -> None:
        cfg = settings.MIRBAD
        web.run_app(
            build_app(),
            host=cfg.bind,
            port=cfg.enroll_port,
            ssl_context=server_context(),
            print=None,
            access_log=None,
            handle_signals=True,
        )
