"""The console's restore: upload and preview (nothing changes), confirm, then the fleet
phase (downloads and starts) shown as steps."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from backups import crypto, fleet_restore
from backups.document import build
from backups.models import RestoreJob, RestoreStep
from models_registry.models import ModelDefinition
from router import keys
from router.models import ApiKey
from tests.factories import make_model, make_node

pytestmark = pytest.mark.django_db
PASS = "a long enough passphrase"


@pytest.fixture
def console(operator: Any) -> Client:
    client = Client()
    client.force_login(operator)
    return client


def _backup_bytes() -> bytes:
    node = make_node("n1")
    model = make_model("alpha", node=node)
    model.auto_start = True
    model.save()
    keys.create_key(name="app", scopes=["chat"])
    data = build(passphrase=PASS, include_ca=False, log2_n=crypto.MIN_LOG2_N).data
    ModelDefinition.objects.all().delete()
    ApiKey.objects.all().delete()
    return data


def _upload(console: Client, data: bytes, passphrase: str = "") -> Any:
    return console.post(
        "/backups/restore/",
        {"document": SimpleUploadedFile("b.json", data), "passphrase": passphrase},
    )


def test_upload_previews_and_changes_nothing(console: Client) -> None:
    data = _backup_bytes()
    answer = _upload(console, data, PASS)
    assert answer.status_code == 302
    job = RestoreJob.objects.get()
    assert answer["Location"] == f"/backups/restore/{job.pk}/"
    assert job.state == "previewed" and job.sealed
    assert not ModelDefinition.objects.exists() and not ApiKey.objects.exists()
    page = console.get(answer["Location"]).content.decode()
    assert 'value="alpha" checked' in page and ">new<" in page
    assert "1 to add" in page


@pytest.mark.parametrize(
    ("data", "passphrase", "message"),
    [
        (b"{", "", "$: is not JSON"),
        (json.dumps({"schemaVersion": 9}).encode(), "", "$.schemaVersion: must be one of 1, 2"),
        (None, "another long passphrase", "wrong passphrase"),
    ],
)
def test_a_bad_upload_is_400_with_the_reason(
    console: Client, data: bytes | None, passphrase: str, message: str
) -> None:
    answer = _upload(console, data if data is not None else _backup_bytes(), passphrase)
    assert answer.status_code == 400
    assert message in answer.content.decode()
    assert not RestoreJob.objects.exists()


def test_confirm_applies_the_selection_and_queues_the_fleet_phase(
    console: Client, django_capture_on_commit_callbacks: Any
) -> None:
    data = _backup_bytes()
    job_url = _upload(console, data)["Location"]
    with mock.patch("backups.tasks.restore_fleet.delay") as queued:
        with django_capture_on_commit_callbacks(execute=True):
            answer = console.post(job_url, {"models": ["alpha"], "passphrase": PASS})
    assert answer.status_code == 302
    job = RestoreJob.objects.get()
    queued.assert_called_once_with(job.pk)
    assert job.state == "running" and bytes(job.document) == b""
    assert ModelDefinition.objects.filter(served_name="alpha").exists()
    assert ApiKey.objects.filter(name="app").exists()
    step = RestoreStep.objects.get()
    assert (step.node_id, step.served_name, step.start, step.phase) == (
        "n1",
        "alpha",
        True,
        "queued",
    )
    page = console.get(job_url).content.decode()
    assert 'id="restore-steps"' in page and "queued" in page
    again = console.post(job_url, {"models": ["alpha"]})
    assert again.status_code == 400 and "applied already" in again.content.decode()


def test_confirm_with_a_wrong_passphrase_changes_nothing(console: Client) -> None:
    job_url = _upload(console, _backup_bytes())["Location"]
    answer = console.post(job_url, {"models": ["alpha"], "passphrase": "not the right one!"})
    assert answer.status_code == 400 and "wrong passphrase" in answer.content.decode()
    assert not ModelDefinition.objects.exists()
    assert RestoreJob.objects.get().state == "previewed"


@pytest.mark.django_db(transaction=True)  # the phase runs each node on a thread of its own
def test_the_fleet_phase_marks_an_unreachable_node_and_ends(console: Client) -> None:
    data = _backup_bytes()
    job_url = _upload(console, data)["Location"]
    with mock.patch("backups.tasks.restore_fleet.delay"):
        console.post(job_url, {"models": ["alpha"]})
    job = RestoreJob.objects.get()
    fleet_restore.run(job.pk, {})
    step = RestoreStep.objects.get()
    assert step.phase == "failed" and "did not answer" in step.note
    assert RestoreJob.objects.get().state == "done"


def test_restore_pages_need_an_operator(viewer: Any) -> None:
    client = Client()
    client.force_login(viewer)
    for path in ("/backups/restore/", "/backups/restore/1/"):
        answer = client.get(path)
        assert answer.status_code == 302 and answer["Location"].startswith("/login/")
