"""On-demand backups: /api/backups and the console's Backups page, the one-time link."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from backups.models import BackupDownload, BackupRun
from backups.reader import parse
from tests.factories import make_model, make_node

pytestmark = pytest.mark.django_db
PASS = "a long enough passphrase"


def test_make_fetch_once(operator_client: APIClient, backup_dir: Path) -> None:
    make_model("alpha", node=make_node("n1"))
    answer = operator_client.post("/api/backups", {"passphrase": PASS}, format="json")
    assert answer.status_code == 201, answer.content
    body = answer.json()
    assert body["run"]["kind"] == "on_demand" and body["run"]["hasSecrets"] is True
    assert body["run"]["hasCa"] is True and body["run"]["models"] == 1
    expires = dt.datetime.fromisoformat(body["expiresAt"])
    assert dt.timedelta(minutes=9) < expires - timezone.now() <= dt.timedelta(minutes=10)
    fetched = operator_client.get(body["downloadUrl"])
    assert fetched.status_code == 200
    assert fetched["Content-Disposition"] == f'attachment; filename="{body["run"]["fileName"]}"'
    assert fetched["Cache-Control"] == "no-store"
    backup = parse(fetched.content, passphrase=PASS)
    assert [m["servedName"] for m in backup.models] == ["alpha"] and backup.ca is not None
    again = operator_client.get(body["downloadUrl"])
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"
    assert not BackupDownload.objects.exists()
    listed = operator_client.get("/api/backups").json()["runs"]
    assert [r["id"] for r in listed] == [body["run"]["id"]]


def test_an_expired_link_is_410_and_gone(operator_client: APIClient) -> None:
    body = operator_client.post("/api/backups", {}, format="json").json()
    assert body["run"]["hasSecrets"] is False
    BackupDownload.objects.update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    answer = operator_client.get(body["downloadUrl"])
    assert answer.status_code == 410 and answer.json()["error"]["code"] == "link_expired"
    assert not BackupDownload.objects.exists()


def test_the_link_needs_an_operator_too(
    operator_client: APIClient, viewer_client: APIClient
) -> None:
    url = operator_client.post("/api/backups", {}, format="json").json()["downloadUrl"]
    assert viewer_client.get(url).status_code == 403
    assert APIClient().get(url).status_code == 401
    assert operator_client.get(url).status_code == 200  # not spent by the refusals


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"passphrase": "short"}, "passphrase must be at least 12 characters"),
        ({"passphrase": 12345678901234}, "passphrase must be a string"),
        ({"passphrase": PASS, "includeCa": "yes"}, "includeCa must be true or false"),
        ({"passphrase": PASS, "extra": 1}, "unknown field"),
        ([1, 2], "object"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    operator_client: APIClient, body: object, message: str
) -> None:
    answer = operator_client.post("/api/backups", body, format="json")
    assert answer.status_code == 400
    assert message in answer.content.decode()
    assert not BackupRun.objects.exists()


@pytest.mark.parametrize("token", ["x", "a" * 200, "../../etc", "%00"])
def test_a_malformed_token_is_404(operator_client: APIClient, token: str) -> None:
    assert operator_client.get(f"/api/backups/download/{token}").status_code == 404


def test_the_console_page_makes_a_backup_and_shows_its_link_once(
    operator: object, backup_dir: Path
) -> None:
    client = Client()
    client.force_login(operator)  # type: ignore[arg-type]
    page = client.get("/backups/")
    assert page.status_code == 200
    assert b"No <code>MIRBAD_BACKUP_PASSPHRASE</code> is set" in page.content
    made = client.post("/backups/", {"passphrase": PASS, "include_ca": "on"})
    assert made.status_code == 302 and made["Location"] == "/backups/"
    shown = client.get("/backups/")
    link = BackupDownload.objects.get()
    assert b'id="backup-link"' in shown.content and b"sealed, with CA" in shown.content
    assert "no-store" in shown["Cache-Control"] or "no-cache" in shown["Cache-Control"]
    assert b'id="backup-link"' not in client.get("/backups/").content
    href = shown.content.decode().split('id="backup-link" href="', 1)[1].split('"', 1)[0]
    fetched = client.get(href)
    assert fetched.status_code == 200 and parse(fetched.content, passphrase=PASS).ca is not None
    assert link.run.actor == "operator"  # the user who asked


def test_the_console_refuses_a_short_passphrase_at_its_field(operator: object) -> None:
    client = Client()
    client.force_login(operator)  # type: ignore[arg-type]
    answer = client.post("/backups/", {"passphrase": "short"})
    assert answer.status_code == 400
    assert b"passphrase must be at least 12 characters" in answer.content
    assert not BackupRun.objects.exists()


def test_the_console_page_needs_an_operator(viewer: object) -> None:
    logged_in = Client()
    logged_in.force_login(viewer)  # type: ignore[arg-type]
    for client in (Client(), logged_in):
        page = client.get("/backups/")
        assert page.status_code == 302 and page["Location"].startswith("/login/")
        assert client.post("/backups/", {"passphrase": PASS}).status_code == 302
    assert not BackupRun.objects.exists()
