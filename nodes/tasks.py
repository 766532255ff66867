"""Celery tasks of the node registry (thin: they call services)."""

from __future__ import annotations

from mirbad_site.celery import app
from nodes import services


@app.task(name="nodes.tasks.renew_bootstrap_bundle", ignore_result=True)
def renew_bootstrap_bundle() -> str | None:
    """Keep the local node's bootstrap bundle valid while it is not enrolled (beat, 5 min)."""
    path = services.write_bootstrap_bundle()
    return str(path) if path else None
