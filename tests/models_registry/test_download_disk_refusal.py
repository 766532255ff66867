"""A node's refusal of a download that does not fit on its models disk, as the master
shows it: /api/downloads passes on the node's 409 ``insufficient_disk`` with its numbers,
and the console's Downloads form shows the same sentence (docs/agent.md, "Logs and disk
space"). The node's side, on a real full disk, is tests/agent/test_disk_full.py.
"""

from __future__ import annotations

import html

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractUser
from django.test import Client
from rest_framework.test import APIClient

from tests.fakehub import FakeHub
from tests.models_registry.test_downloads_api import (  # noqa: F401  (fixtures, used by name)
    REPO,
    VALID,
    Master,
    connect,
    gguf_bytes,
    hub,
)
from tests.nodes.conftest import Enrolled

pytestmark = pytest.mark.timeout(60)

RESERVE = 10**15  # more than any disk this test runs on has free


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after", "status_redis", "master_identity")
async def test_the_master_shows_a_nodes_disk_refusal(
    enrolled: Enrolled,
    operator: AbstractUser,
    operator_client: APIClient,
    hub: FakeHub,  # noqa: F811  (the fixture imported above)
    gguf_bytes: bytes,  # noqa: F811
) -> None:
    await connect(enrolled)
    downloads = enrolled.server.downloads
    downloads.reserve_bytes = RESERVE
    master = Master(operator_client)

    answer = await master.call("post", "/api/downloads", VALID)
    assert answer.status_code == 409, answer.json()
    error = answer.json()["error"]
    assert error["code"] == "insufficient_disk"
    message = error["message"]
    assert message.startswith(f"Node n1: download 'tiny' needs 0.00 GiB ({len(gguf_bytes)} bytes)")
    assert f"keeps {RESERVE / 2**30:.2f} GiB ({RESERVE} bytes) free" in message
    assert "POST it again" in message
    details = error["details"]
    assert details["neededBytes"] == len(gguf_bytes) and details["reserveBytes"] == RESERVE
    assert 0 < details["freeBytes"] < RESERVE and details["otherDownloadsBytes"] == 0
    assert downloads.list() == [], "a refusal records nothing on the node"
    assert not (enrolled.server.config.models_root_path / "tiny.partial").exists()

    # The console's form: the same sentence above the form, the status kept.
    client = Client()
    await sync_to_async(client.force_login)(operator)
    form = {"repo": REPO, "variant": "tiny-Q8_0.gguf", "node": "n1", "folder": "tiny"}
    page = await sync_to_async(client.post)("/downloads/start/", form)
    assert page.status_code == 409
    shown = page.content.decode()
    needs = f"Node n1: download 'tiny' needs 0.00 GiB ({len(gguf_bytes)} bytes) more, and "
    assert f'id="download-start-error">{html.escape(needs)}' in shown  # then the free bytes
    assert "lower DownloadReserveBytes) and POST it again" in shown

    # With room again, the same request starts.
    downloads.reserve_bytes = 0
    started = await master.call("post", "/api/downloads", VALID)
    assert started.status_code == 202, started.json()
    done = await master.finished("tiny")
    assert done["state"] == "Completed", done
