"""A master state file that cannot be written is a clear 503, never a bare 500 (issue 17,
part 5): the takeover's record through the API and the console, and any other
AtomicWriteError reaching the API's exception handler."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.test import Client

from core.api_errors import exception_handler
from nodes.models import AuditEvent
from protocol.atomic import AtomicWriteError


@pytest.fixture
def takeover_file_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fsync of takeover.json (its temp file) fails with EIO."""
    real = os.fsync

    def fsync(fd: Any) -> None:
        if "takeover.json" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.django_db
def test_a_takeover_whose_record_cannot_be_written_is_a_503_naming_it(
    operator_client: Any, takeover_file_fails: None
) -> None:
    resp = operator_client.post("/api/takeover")
    assert resp.status_code == 503, resp.content
    error = resp.json()["error"]
    assert error["code"] == "state_unavailable"
    assert error["message"].startswith("the takeover is done (epoch ")
    assert "takeover.json: fsync of the temp file failed (Input/output error)" in error["message"]
    # The epoch moved and the audit log has it, whatever the disk did.
    assert AuditEvent.objects.filter(action="master.takeover").count() == 1


@pytest.mark.django_db
def test_the_console_shows_it_as_a_message(operator: Any, takeover_file_fails: None) -> None:
    client = Client()
    client.force_login(operator)
    resp = client.post("/takeover/")
    assert resp.status_code == 302
    shown = [str(m) for m in get_messages(resp.wsgi_request)]
    assert any("takeover.json: fsync of the temp file failed" in m for m in shown), shown


def test_any_state_file_error_reaching_the_api_is_a_503_naming_the_file() -> None:
    error = AtomicWriteError(
        "/data/pki/master-client.pem",
        "fsync of the temp file",
        OSError(errno.EIO, os.strerror(errno.EIO)),
        "the old file is kept",
    )
    resp = exception_handler(error, {})
    assert resp is not None and resp.status_code == 503
    assert resp.data == {
        "error": {
            "code": "state_unavailable",
            "message": "cannot write /data/pki/master-client.pem: fsync of the temp file failed "
            "(Input/output error); the old file is kept",
        }
    }
