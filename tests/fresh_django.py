"""Django settings as a fresh process builds them from ``MIRBAD_*`` variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_django(tmp_path: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh process whose settings come from ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MIRBAD_")}
    environ.update(
        MIRBAD_DATA_PATH=str(tmp_path / "data"),
        MIRBAD_REDIS_URL=os.environ.get("MIRBAD_REDIS_URL", "redis://127.0.0.1:6379/0"),
        DJANGO_SETTINGS_MODULE="mirbad_site.settings",
        **env,
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
