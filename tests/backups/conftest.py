"""Backups tests: a backup directory of their own, a cheap scrypt for sealing in loops."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def backup_dir(settings: Any, tmp_path: Path) -> Path:
    directory = tmp_path / "backups"
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, backup_directory=directory)
    return directory


@pytest.fixture
def with_passphrase(settings: Any, backup_dir: Path) -> str:
    passphrase = "correct horse battery staple"
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, backup_passphrase=passphrase)
    return passphrase
