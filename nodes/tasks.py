"""Celery tasks of the node registry (thin: they call services)."""

from __future__ import annotations

from celery import shared_task

from nodes import services


# shared_task binds to the project's app (mirbad_site/celery.py) without importing it:
# nodes sits below the project (docs/architecture.md, "Layers").
@shared_task(name="nodes.tasks.renew_bootstrap_bundle", ignore_result=True)
def renew_bootstrap_bundle() -> str | None:
    """Keep the local node's bootstrap bundle valid while it is not enrolled (beat, 5 min)."""
    path = services.write_bootstrap_bundle()
    return str(path) if path else None
