"""The join command refuses bad input at once, with the fix in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _join(*extra: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "join",
            "--enroll-url",
            "https://127.0.0.1:1",
            "--ca-hash",
            "sha256:AAAA",
            "--state-dir",
            str(tmp),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_token_on_the_command_line_is_refused(tmp_path: Path) -> None:
    result = _join("--node-id", "n1", "--token", "secret-value", tmp=tmp_path)
    assert result.returncode == 2
    assert "MIRBAD_JOIN_TOKEN" in result.stderr and "secret-value" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_node_id_is_refused(tmp_path: Path) -> None:
    result = _join("--node-id", "Not_Valid", tmp=tmp_path)
    assert result.returncode == 2
    assert "--node-id: 'Not_Valid' is not a valid node id" in result.stderr
