"""``manage.py monitor``: the one active monitor, until SIGINT/SIGTERM.

It first takes the monitor lock (a second monitor waits as a standby), then
raises the fencing epoch in the database (nodes.fencing, D81), and only then dials
any agent.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from nodes.fencing import MonitorLock, begin_epoch
from nodes.monitor import Monitor


class Command(BaseCommand):
    help = "Follow every approved node: snapshots, events, telemetry, the status cache."

    def handle(self, *args: Any, **options: Any) -> None:
        cfg = settings.MIRBAD
        stopping = {"flag": False}

        def stop(signum: int, frame: object) -> None:
            stopping["flag"] = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        lock = MonitorLock(data_path=cfg.data_path, database_url=cfg.database_url)
        if not lock.acquire(should_stop=lambda: stopping["flag"]):
            return
        try:
            begin_epoch(cfg.data_path)
            if not stopping["flag"]:
                asyncio.run(self._run())
        finally:
            lock.release()

    async def _run(self) -> None:
        monitor = Monitor()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, monitor.stop.set)
        await monitor.run()
