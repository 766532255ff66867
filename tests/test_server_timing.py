"""MIRBAD_SERVER_TIMING: the answer says how long the server worked, and only when asked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

ROOT = Path(__file__).resolve().parent.parent
TIMING = re.compile(r"^app;dur=(\d+\.\d), cpu;dur=(\d+\.\d)$")


def _middleware(tmp_path: Path, **env: str) -> list[str]:
    """The MIDDLEWARE a fresh process builds from ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MIRBAD_")}
    environ.update(
        MIRBAD_DATA_PATH=str(tmp_path / "data"),
        MIRBAD_REDIS_URL=os.environ.get("MIRBAD_REDIS_URL", "redis://127.0.0.1:6379/0"),
        DJANGO_SETTINGS_MODULE="mirbad_site.settings",
        **env,
    )
    code = "from django.conf import settings; print('\\n'.join(settings.MIDDLEWARE))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
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
