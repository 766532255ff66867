"""MIRBAD_SERVER_TIMING: the answer says how long the server worked, and only when asked."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from tests.fresh_django import run_django

TIMING = re.compile(r"^app;dur=(\d+\.\d), cpu;dur=(\d+\.\d)$")


def _middleware(tmp_path: Path, **env: str) -> list[str]:
    """The MIDDLEWARE a fresh process builds from ``env``."""
    code = "from django.conf import settings; print('\\n'.join(settings.MIDDLEWARE))"
    done = run_django(tmp_path, code, **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_off_by_default_and_first_when_on(tmp_path: Path) -> None:
    assert "mirbad_site.server_timing.ServerTimingMiddleware" not in _middleware(tmp_path)
    on = _middleware(tmp_path, MIRBAD_SERVER_TIMING="true")
    assert on[0] == "mirbad_site.server_timing.ServerTimingMiddleware"


@pytest.mark.django_db
def test_an_answer_carries_its_wall_and_cpu_time(settings: Any) -> None:
    settings.MIDDLEWARE = ["mirbad_site.server_timing.ServerTimingMiddleware", *settings.MIDDLEWARE]
    answer = Client().get("/login/")
    assert answer.status_code == 200
    found = TIMING.match(answer["Server-Timing"])
    assert found is not None, answer["Server-Timing"]
    app, cpu = (float(v) for v in found.groups())
    assert 0 < app and 0 <= cpu


@pytest.mark.django_db
def test_no_header_without_it() -> None:
    assert "Server-Timing" not in Client().get("/login/")
