"""``manage.py bootstrap``: migrate, create the CA and the bootstrap node's bundle.

Run once before the other processes start (compose's ``migrate`` service;
``./mirbad up`` does the same steps in-process). Safe to repeat.
"""

from __future__ import annotations

from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand

from nodes import services


class Command(BaseCommand):
    help = "Migrate the database, create the CA and write the bootstrap bundle."

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("migrate", interactive=False, verbosity=options.get("verbosity", 1))
        mp = services.master_pki()
        node = services.ensure_bootstrap_node()
        path = services.write_bootstrap_bundle()
        self.stdout.write(f"CA {mp.ca.spki_sha256}; bootstrap node {node.node_id}")
        self.stdout.write(f"bundle: {path}" if path else "bootstrap node already enrolled")
