"""``manage.py takeover``: raise the epoch above every reachable agent's.

Run it only after making sure the previous master is stopped.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand

from nodes import audit, takeover


class Command(BaseCommand):
    help = "Fencing takeover: raise this master's epoch above every reachable agent's."

    def handle(self, *args: Any, **options: Any) -> None:
        with audit.acting_as("manage.py takeover", "local"):
            record = takeover.takeover()
        self.stdout.write(json.dumps(record, indent=2))
