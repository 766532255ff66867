"""The Celery application: Redis broker, JSON only, tasks discovered per app."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")

app = Celery("mirbad")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
