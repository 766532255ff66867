"""A task queued from a process that only loaded Django (the web) goes to our broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import django
django.setup()
from django.conf import settings
from nodes.tasks import drive_rotation
print(drive_rotation.app.main, drive_rotation.app.conf.broker_url == settings.CELERY_BROKER_URL)
"""


def test_tasks_bind_to_the_projects_app_in_a_process_that_only_loads_django() -> None:
    # Before, the web process never imported mirbad_site.celery: "rotate now" was sent
    # to Celery's default app, whose broker is amqp://localhost, and no worker saw it.
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "mirbad_site.settings"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    assert out.stdout.split() == ["mirbad", "True"], out.stdout + out.stderr
