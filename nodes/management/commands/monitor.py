"""``manage.py monitor``: run the node monitor until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from django.core.management.base import BaseCommand

from nodes.monitor import Monitor


class Command(BaseCommand):
    help = "Follow every approved node: snapshots, events, telemetry, the status cache."

    def handle(self, *args: Any, **options: Any) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        monitor = Monitor()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, monitor.stop.set)
        await monitor.run()
