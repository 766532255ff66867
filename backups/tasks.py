"""Beat's backup task: makes the day's scheduled backup when it is due."""

from __future__ import annotations

from celery import shared_task

from backups import services


@shared_task(name="backups.tasks.scheduled_backup", ignore_result=True)
def scheduled_backup() -> int | None:
    """Run every MIRBAD_BACKUP_CHECK_SECONDS; at most one backup per local day is made.

    No Celery retry: a failed run is recorded and the next tick after
    ``services.RETRY_AFTER`` tries again, which is the retry.
    """
    run = services.scheduled_tick()
    return run.pk if run is not None else None


@shared_task(name="backups.tasks.restore_fleet", ignore_result=True)
def restore_fleet(job_id: int) -> None:
    """A confirmed restore's fleet phase: downloads, then auto-starts (backups.fleet_restore).

    No retry: each step records its own failure, and the operator starts what is left.
    """
    from backups import fleet_restore
    from backups.models import RestoreJob

    job = RestoreJob.objects.filter(pk=job_id, state=RestoreJob.State.RUNNING).first()
    if job is not None:
        fleet_restore.run(job.pk, (job.applied or {}).get("sources") or {})
