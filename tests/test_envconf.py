"""The MIRBAD_* parsers fail loudly, naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import load_master_config
from core.envconf import (
    SettingError,
    env_bool,
    env_int,
    env_list,
    env_port,
    env_secret,
    env_url,
)


def test_int_parses_and_defaults() -> None:
    assert env_int("X", 5, env={}) == 5
    assert env_int("X", 5, env={"X": " 7 "}) == 7


@pytest.mark.parametrize("value", ["abc", "1.5", "0x10", ""])
def test_int_rejects_garbage_naming_the_variable(value: str) -> None:
    if value == "":
        assert env_int("MIRBAD_X", 3, env={"MIRBAD_X": value}) == 3  # empty = unset
        return
    with pytest.raises(SettingError, match="MIRBAD_X"):
        env_int("MIRBAD_X", 3, env={"MIRBAD_X": value})


def test_port_range() -> None:
    with pytest.raises(SettingError, match=r"MIRBAD_PORT: 70000 is out of range"):
        env_port("MIRBAD_PORT", 8080, env={"MIRBAD_PORT": "70000"})
    with pytest.raises(SettingError, match="MIRBAD_PORT"):
        env_port("MIRBAD_PORT", 8080, env={"MIRBAD_PORT": "0"})


def test_bool() -> None:
    assert env_bool("B", False, env={"B": "yes"}) is True
    assert env_bool("B", True, env={"B": "off"}) is False
    with pytest.raises(SettingError, match="B: expected true or false"):
        env_bool("B", True, env={"B": "maybe"})


def test_list_rejects_empty_items() -> None:
    assert env_list("L", ["a"], env={"L": "x, y"}) == ["x", "y"]
    with pytest.raises(SettingError, match="L: empty item"):
        env_list("L", [], env={"L": "x,,y"})


def test_url_schemes() -> None:
    assert env_url("U", None, schemes=("redis",), env={"U": "redis://h:6379/0"})
    with pytest.raises(SettingError, match="U: 'http://h' must start with one of redis://"):
        env_url("U", None, schemes=("redis",), env={"U": "http://h"})
    with pytest.raises(SettingError, match=r"U: .* invalid port"):
        env_url("U", None, schemes=("redis",), env={"U": "redis://h:99999"})


def test_secret_from_file(tmp_path: Path) -> None:
    secret = tmp_path / "s"
    secret.write_text("hunter2-but-longer\n")
    assert env_secret("S", env={"S_FILE": str(secret)}) == "hunter2-but-longer"
    with pytest.raises(SettingError, match="S and S_FILE are both set"):
        env_secret("S", env={"S": "x", "S_FILE": str(secret)})
    with pytest.raises(SettingError, match="S_FILE: cannot read"):
        env_secret("S", env={"S_FILE": str(tmp_path / "missing")})


def test_master_config_defaults(tmp_path: Path) -> None:
    cfg = load_master_config({"MIRBAD_DATA_PATH": str(tmp_path)})
    assert cfg.port == 8080 and cfg.enroll_port == 8443 and cfg.agent_port == 9443
    assert cfg.database_url == f"sqlite:///{tmp_path / 'db.sqlite3'}"
    assert cfg.redis_embedded and cfg.redis_url.startswith("unix://")
    assert cfg.bootstrap_agent_address == "https://127.0.0.1:9443"


def test_master_config_moves_with_ports(tmp_path: Path) -> None:
    cfg = load_master_config(
        {
            "MIRBAD_DATA_PATH": str(tmp_path),
            "MIRBAD_AGENT_PORT": "9555",
            "MIRBAD_ENROLL_PORT": "8555",
        }
    )
    assert cfg.bootstrap_agent_address == "https://127.0.0.1:9555"
    assert cfg.enroll_endpoint == "https://127.0.0.1:8555"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MIRBAD_DATABASE_URL", "mysql://x/y"),
        ("MIRBAD_REDIS_URL", "http://x"),
        ("MIRBAD_BOOTSTRAP_NODE_ID", "Bad_Name"),
        ("MIRBAD_LOG_LEVEL", "LOUD"),
        ("MIRBAD_DEBUG", "perhaps"),
        ("MIRBAD_BACKUP_DAILY_AT", "3am"),
        ("MIRBAD_BACKUP_DAILY_AT", "24:00"),
        ("MIRBAD_BACKUP_KEEP", "0"),
        ("MIRBAD_BACKUP_PASSPHRASE", "too short"),
        ("MIRBAD_BACKUP_INCLUDE_CA", "maybe"),
        ("MIRBAD_BACKUP_CHECK_SECONDS", "0"),
        ("MIRBAD_MASTER_KEY", "shorter than 32 characters"),
    ],
)
def test_master_config_names_the_bad_variable(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(SettingError, match=name):
        load_master_config({"MIRBAD_DATA_PATH": str(tmp_path), name: value})


def test_backup_settings_defaults_and_passphrase_file(tmp_path: Path) -> None:
    cfg = load_master_config({"MIRBAD_DATA_PATH": str(tmp_path)})
    assert (cfg.backup_daily_at, cfg.backup_keep, cfg.backup_include_ca) == ("03:00", 14, True)
    assert cfg.backup_directory == tmp_path / "backups" and cfg.backup_passphrase is None
    secret = tmp_path / "pass"
    secret.write_text("a passphrase from a file\n")
    cfg = load_master_config(
        {"MIRBAD_DATA_PATH": str(tmp_path), "MIRBAD_BACKUP_PASSPHRASE_FILE": str(secret)}
    )
    assert cfg.backup_passphrase == "a passphrase from a file"
    assert "a passphrase from a file" not in repr(cfg)
