"""Celery tasks of the router (thin: they call services)."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.conf import settings


@shared_task(name="router.tasks.unload_idle_models", ignore_result=True)  # type: ignore[untyped-decorator]  # celery has no types
def unload_idle_models() -> list[dict[str, Any]]:
    """Beat (10 s): stop the replicas idle for their model's ``idleUnloadSeconds``
    (models_registry.ondemand.unload_idle, with the fair queue's activity in Redis)."""
    from models_registry import ondemand
    from router.ondemand import USAGE

    return ondemand.unload_idle(usage=USAGE)


@shared_task(name="router.tasks.prune_usage_hours", ignore_result=True)  # type: ignore[untyped-decorator]  # as above
def prune_usage_hours() -> int:
    """Beat (hourly): drop hourly usage rows older than MIRBAD_USAGE_HOURLY_KEEP_DAYS;
    the day and month rollups stay (router.usage.prune_hourly)."""
    from router import usage

    return usage.prune_hourly(keep_days=settings.MIRBAD.usage_hourly_keep_days)
