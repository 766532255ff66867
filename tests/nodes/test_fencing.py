"""Epochs (the database row), the outrank rule, the monitor lock and takeover."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodes import fencing


@pytest.mark.django_db
def test_epoch_rises_every_start_and_keeps_the_instance(tmp_path: Path) -> None:
    from nodes.models import MasterState

    first = fencing.begin_epoch(tmp_path)
    second = fencing.begin_epoch(tmp_path)
    assert second.epoch == first.epoch + 1
    assert second.instance_id == first.instance_id and second.boot_id != first.boot_id
    assert fencing.begin_epoch(tmp_path, at_least=10).epoch == 10
    headers = fencing.request_headers(tmp_path)
    row = MasterState.objects.get()
    assert headers["MirbadLLM-Master"] == f"{first.instance_id}/10/{row.boot_id}"
    assert not (tmp_path / "master.json").exists()  # the database holds it, nothing else


@pytest.mark.django_db
def test_missing_and_broken_master_json(tmp_path: Path) -> None:
    with pytest.raises(fencing.FencingError, match="monitor has not started"):
        fencing.request_headers(tmp_path)
    fencing.forget()
    (tmp_path / "master.json").write_text("{")  # an earlier release's, to import
    with pytest.raises(fencing.FencingError, match="unreadable"):
        fencing.read_identity(tmp_path)


def test_outranks() -> None:
    me = fencing.MasterIdentity("m1", 5, "b1")
    assert not fencing.outranks(None, me)
    assert not fencing.outranks({"instanceId": "m1", "epoch": 5, "bootId": "b1"}, me)
    assert not fencing.outranks({"instanceId": "m0", "epoch": 4, "bootId": "x"}, me)
    assert fencing.outranks({"instanceId": "m2", "epoch": 6, "bootId": "x"}, me)
    assert fencing.outranks({"instanceId": "m1", "epoch": 5, "bootId": "other"}, me)


def test_file_lock_admits_one_monitor(tmp_path: Path) -> None:
    first = fencing.MonitorLock(data_path=tmp_path, database_url="sqlite:///x")
    second = fencing.MonitorLock(data_path=tmp_path, database_url="sqlite:///x")
    assert first.try_acquire()
    assert not second.try_acquire()
    assert not second.acquire(should_stop=lambda: True)
    first.release()
    assert second.try_acquire()
    second.release()


@pytest.mark.django_db
def test_advisory_lock_admits_one_monitor(tmp_path: Path) -> None:
    from django.conf import settings

    url = settings.MIRBAD.database_url
    if not url.startswith("postgres"):
        pytest.skip("the advisory lock needs PostgreSQL (MIRBAD_DATABASE_URL); CI runs it")
    first = fencing.MonitorLock(data_path=tmp_path, database_url=url)
    second = fencing.MonitorLock(data_path=tmp_path, database_url=url)
    try:
        assert first.try_acquire()
        assert not second.try_acquire()
        first.release()  # the holder's session ends: a standby gets it
        assert second.try_acquire()
    finally:
        first.release()
        second.release()
