"""A restore's fleet phase: fetch missing folders, then start the auto-start models.

After :func:`backups.restore.apply` wrote the definitions, each node gets, one after
another, every missing folder of the restored models placed on it (downloaded
through its agent from the source the backup recorded), then each auto-start model
whose files are present, waiting for each start to end before the next; nodes
proceed in parallel. A model that does not fit is left stopped with the reason.
Each step is a :class:`RestoreStep` row, and each change tells the restore's page
(``restore.updated`` on ``fleet``).
"""

from __future__ import annotations

import glob
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import async_to_sync
from django.db import connections, transaction
from django.utils import timezone

from backups import inventory, restore
from backups.models import RestoreJob, RestoreStep
from backups.reader import Backup, parse
from core.errors import ServiceError
from models_registry import downloads, lifecycle
from models_registry.models import ModelDefinition
from nodes import events
from nodes.agent_client import AgentClient, AgentError
from nodes.models import Node

log = logging.getLogger("mirbad.backups")

NODES_AT_ONCE = 8
POLL_SECONDS = 1.0
DOWNLOAD_TIMEOUT = 24 * 3600.0  # a large checkpoint over a slow link
START_TIMEOUT = 1800.0  # llama-server loading a large model from a slow disk
Phase = RestoreStep.Phase


def upload(data: bytes, *, passphrase: str | None, file_name: str, actor: str) -> RestoreJob:
    """Read an uploaded backup and keep it with its preview; nothing else changes.

    Raises BackupInvalid (the JSON path of the first problem, or "wrong passphrase").
    """
    backup = parse(data, passphrase=passphrase)
    return RestoreJob.objects.create(
        actor=actor[:150], file_name=file_name[:200], document=data, sealed=backup.sealed,
        preview=restore.preview(backup),
    )  # fmt: skip


def confirm(
    job: RestoreJob,
    *,
    passphrase: str | None,
    served_names: list[str] | None,
    actor: str,
    queue: bool = True,
) -> RestoreJob:
    """Apply a previewed restore, then queue its fleet phase (after the commit); with
    ``queue`` false the caller runs it (``manage.py restore``)."""
    if job.state != RestoreJob.State.PREVIEWED:
        raise ServiceError(409, "invalid_state", "This restore was applied already.")
    backup = parse(bytes(job.document), passphrase=passphrase)
    with transaction.atomic():
        applied = restore.apply(backup, served_names=served_names, actor=actor)
        applied["sources"] = backup.sources
        RestoreJob.objects.filter(pk=job.pk).update(
            state=RestoreJob.State.RUNNING, applied=applied, document=b""
        )
        job.refresh_from_db()
        plan(job, backup, applied)
        if queue:
            from backups import tasks  # the task module imports this one

            transaction.on_commit(lambda: tasks.restore_fleet.delay(job.pk))
    return job


def plan(job: RestoreJob, backup: Backup, applied: dict[str, Any]) -> int:
    """One step per restored model and placement; the number of steps."""
    written = {
        r["servedName"]
        for r in applied["models"]
        if r["result"] in ("created", "updated", "unchanged")
    }
    auto = {r["servedName"]: r["autoStart"] for r in backup.models}
    steps = []
    models = ModelDefinition.objects.filter(served_name__in=written).prefetch_related(
        "placements__node"
    )
    for model in models:
        for placement in model.placements.all():
            steps.append(
                RestoreStep(
                    job=job, node_id=placement.node.node_id, served_name=model.served_name,
                    model_id_ref=model.pk, folder=model.source_folder,
                    start=bool(auto.get(model.served_name)),
                )
            )  # fmt: skip
    RestoreStep.objects.bulk_create(steps)
    return len(steps)


def _tell(job_id: int, state: str = RestoreJob.State.RUNNING) -> None:
    try:
        async_to_sync(events.publish)(
            {"type": "restore.updated", "jobId": job_id, "state": str(state)}
        )
    except Exception:  # a page that misses one event resyncs on its next; never fail the job
        log.debug("restore.updated not published", exc_info=True)


def _set(step: RestoreStep, phase: str, note: str = "", **fields: Any) -> None:
    step.phase, step.note = phase, note[:500]
    for name, value in fields.items():
        setattr(step, name, value)
    step.save()
    _tell(step.job_id)


def _wait(until: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until():
            return True
        time.sleep(POLL_SECONDS)
    return False


def _fetch(step: RestoreStep, source: dict[str, Any]) -> bool:
    """Download one folder through the node's agent and follow it; True once complete."""
    names = [glob.escape(f["name"]) for f in source["files"]]
    body = {"folder": step.folder, "repoId": source["repoId"], "revision": source["revision"],
            "allowPatterns": names}  # fmt: skip
    try:
        downloads.start_download(step.node_id, body)
    except ServiceError as exc:
        _set(step, Phase.FAILED, f"the download was refused: {exc.message}")
        return False
    _set(step, Phase.DOWNLOADING, bytes_total=source.get("bytes"), bytes_done=0)
    last: dict[str, Any] = {}

    def finished() -> bool:
        nonlocal last
        try:
            last = downloads.get_download(step.node_id, step.folder)
        except ServiceError as exc:
            last = {"state": "Unknown", "error": exc.message}
            return False
        if last.get("bytesDone") != step.bytes_done:
            _set(step, Phase.DOWNLOADING, bytes_done=last.get("bytesDone"),
                 bytes_total=last.get("bytesTotal") or step.bytes_total)  # fmt: skip
        return last.get("state") in ("Completed", "Failed", "Cancelled")

    if not _wait(finished, DOWNLOAD_TIMEOUT):
        _set(step, Phase.FAILED, "the download did not finish in time; see Downloads")
        return False
    if last.get("state") != "Completed":
        _set(
            step, Phase.FAILED, f"the download ended {last.get('state')}: {last.get('error') or ''}"
        )
        return False
    _set(step, Phase.DOWNLOADED, bytes_done=last.get("bytesDone"))
    return True


def _start(step: RestoreStep, node: Node) -> None:
    """Start one auto-start model on this node and wait for the start to end."""
    assert step.model_id_ref is not None
    try:
        lifecycle.start_model(step.model_id_ref, node_id=step.node_id)
    except ServiceError as exc:
        # Does not fit, node draining, ...: left stopped, saying why (on the model too).
        ModelDefinition.objects.filter(pk=step.model_id_ref).update(
            auto_start_note=exc.message[:500]
        )
        _set(step, Phase.STOPPED, exc.message)
        return
    _set(step, Phase.STARTING)
    state: dict[str, str] = {}

    def ended() -> bool:
        try:
            with AgentClient(node=node, timeout=10) as client:
                instances = client.instances()
        except AgentError:
            return False
        for instance in instances:
            if instance.get("modelId") == step.model_id_ref or str(
                instance.get("instanceId", "")
            ).startswith(f"m{step.model_id_ref}-"):
                state["now"] = str(instance.get("state"))
                return state["now"] in ("Ready", "Failed", "Stopped")
        return False

    if not _wait(ended, START_TIMEOUT):
        _set(step, Phase.FAILED, "still starting after the wait; see the model's page")
    elif state.get("now") == "Ready":
        _set(step, Phase.STARTED)
    else:
        _set(step, Phase.FAILED, f"the engine ended {state.get('now')}; see the model's log")


def _run_node(job_id: int, node_id: str, sources: dict[str, Any]) -> None:
    try:
        steps = list(RestoreStep.objects.filter(job_id=job_id, node_id=node_id))
        files = dict(
            ModelDefinition.objects.filter(pk__in=[s.model_id_ref for s in steps]).values_list(
                "pk", "source_file"
            )
        )
        node = Node.objects.filter(node_id=node_id).first()
        answer = inventory.ask_nodes([node]).get(node_id) if node is not None else None
        if node is None or answer is None or answer.folders is None:
            why = answer.problem if answer is not None else "it is not on this master"
            for step in steps:
                _set(
                    step,
                    Phase.FAILED,
                    f"node {node_id} did not answer ({why}); start it there later",
                )
            return
        ready: set[str] = set()  # "folder/file" pairs in place on this node

        def file_of(step: RestoreStep) -> str:
            return files.get(step.model_id_ref or 0, "")

        for step in steps:  # folders first, one download at a time on this node
            wanted = f"{step.folder}/{file_of(step)}"
            if wanted in ready or inventory.holds(answer.folders, step.folder, file_of(step)):
                _set(step, Phase.PRESENT)
                ready.add(wanted)
            elif step.folder in sources:
                if _fetch(step, sources[step.folder]):
                    ready.add(wanted)
            else:
                _set(step, Phase.MISSING, "the backup records no source for this folder; "
                     "copy it onto the node")  # fmt: skip
        for step in steps:  # then the starts, one after another
            if step.start and f"{step.folder}/{file_of(step)}" in ready:
                _start(step, node)
    finally:
        connections.close_all()  # this thread's database connection


def run(job_id: int, sources: dict[str, Any]) -> None:
    """The fleet phase of one restore: nodes in parallel, each node's steps in order."""
    nodes = sorted(set(RestoreStep.objects.filter(job_id=job_id).values_list("node_id", flat=True)))
    if nodes:
        with ThreadPoolExecutor(max_workers=min(NODES_AT_ONCE, len(nodes))) as pool:
            list(pool.map(lambda n: _run_node(job_id, n, sources), nodes))
    RestoreJob.objects.filter(pk=job_id).update(
        state=RestoreJob.State.DONE, finished_at=timezone.now()
    )
    _tell(job_id, RestoreJob.State.DONE)
