"""``manage.py enroll_listener``: serve POST /enroll over TLS until stopped."""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from nodes.enroll_listener import EnrollTls, serve


class Command(BaseCommand):
    help = "Serve the enroll listener (POST /enroll, GET /ca) on MIRBAD_ENROLL_PORT."

    def handle(self, *args: Any, **options: Any) -> None:
        cfg = settings.MIRBAD
        tls = EnrollTls()
        asyncio.run(serve(cfg.bind, cfg.enroll_port, tls.context, cfg.http_limits, tls=tls))
