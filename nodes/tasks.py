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


@shared_task(name="nodes.tasks.drive_rotation", ignore_result=True)
def drive_rotation(rotation_id: str) -> str:
    """Take one certificate rotation as far as it goes now (nodes/rotation.drive), and
    queue the next pass when it must wait (the pin grace) or a step failed; the beat's
    check_certificates resumes whatever this chain leaves."""
    from nodes import rotation

    reached, delay = rotation.drive(rotation_id)
    if delay is not None:
        drive_rotation.apply_async((rotation_id,), countdown=delay)
    return str(reached.stage)


@shared_task(name="nodes.tasks.check_certificates", ignore_result=True)
def check_certificates() -> dict[str, int]:
    """Beat (MIRBAD_CERT_CHECK_SECONDS): due node renewals and open rotations."""
    from nodes import rotation

    return rotation.check_certificates()


@shared_task(name="nodes.tasks.prune_audit_log", ignore_result=True)
def prune_audit_log() -> int:
    """Beat (hourly): drop audit events older than MIRBAD_AUDIT_KEEP_DAYS."""
    from nodes import audit

    return audit.prune(keep_days=services.config().audit_keep_days)
