"""Config loading: defaults, every bad field named, env overrides, CLI exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent import AgentConfig, ConfigError, load_config
from agent.__main__ import main
from agent._config import env_name

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "agent.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def minimal(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"NodeId": "n1", "StateDirectory": str(tmp_path / "state"), **extra}


def test_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, minimal(tmp_path)), environ={})
    assert isinstance(config, AgentConfig)
    assert config.node_id == "n1"
    assert config.listen_address == "127.0.0.1"
    assert config.port == 9443
    assert config.models_root == tmp_path / "state" / "models"
    assert config.bootstrap_directory is None
    assert config.bootstrap_wait_seconds == 600
    assert config.addresses == ()
    assert config.executables == ()
    assert (config.port_range_start, config.port_range_end) == (8101, 65535)
    assert config.process_start_timeout_seconds == 600
    assert (config.restart_budget, config.restart_window_seconds) == (2, 600)
    assert config.proxy_max_in_flight == 512
    assert config.proxy_upstream_idle_timeout_seconds == 1200
    assert config.health_check_interval_seconds == 5
    assert config.shutdown_timeout_seconds == 30
    assert config.stop_instances_on_shutdown is False
    assert config.log_level == "INFO"
    assert config.enroll_addresses == ["https://127.0.0.1:9443"]


def test_full_file_and_relative_paths(tmp_path: Path) -> None:
    exe = {"Name": "llama.cpp", "Version": "0.6.0-dev", "Path": "rt/llama-server", "Default": True}
    config = load_config(
        write(
            tmp_path,
            {
                "NodeId": "box-2",
                "StateDirectory": "state",
                "ModelsRoot": "/srv/models",
                "Port": 9444,
                "Addresses": ["10.0.0.5", "https://box:9000"],
                "Executables": [exe],
                "ProxyUpstreamIdleTimeoutSeconds": 0,
                "LogLevel": "debug",
            },
        ),
        environ={},
    )
    assert config.state_directory == tmp_path / "state"
    assert config.models_root == Path("/srv/models")
    assert config.addresses == ("https://10.0.0.5:9444", "https://box:9000")
    assert config.executables[0].path == tmp_path / "rt" / "llama-server"
    assert config.executables[0].default is True
    assert config.proxy_upstream_idle_timeout_seconds == 0
    assert config.log_level == "DEBUG"


BAD_FIELDS = [
    ({"NodeId": "Bad_Id"}, "NodeId"),
    ({"NodeId": ""}, "NodeId"),
    ({"StateDirectory": 5}, "StateDirectory"),
    ({"ListenAddress": "localhost"}, "ListenAddress"),
    ({"Port": "9443"}, "Port"),
    ({"Port": 70000}, "Port"),
    ({"Port": True}, "Port"),
    ({"ModelsRoot": ""}, "ModelsRoot"),
    ({"BootstrapDirectory": 3}, "BootstrapDirectory"),
    ({"BootstrapWaitSeconds": -1}, "BootstrapWaitSeconds"),
    ({"Addresses": "10.0.0.1"}, "Addresses"),
    ({"Addresses": ["http://10.0.0.1"]}, "Addresses"),
    ({"Executables": [{"Name": "llama.cpp"}]}, "Executables"),
    ({"Executables": [{"Name": "x", "Version": "1", "Path": "/a", "Extra": 1}]}, "Executables"),
    (
        {
            "Executables": [
                {"Name": "x", "Version": "1", "Path": "/a"},
                {"Name": "x", "Version": "2", "Path": "/b"},
            ]
        },
        "Executables",
    ),
    ({"PortRangeStart": 0}, "PortRangeStart"),
    ({"PortRangeStart": 9000, "PortRangeEnd": 8000}, "PortRangeEnd"),
    ({"ProcessStartTimeoutSeconds": 0}, "ProcessStartTimeoutSeconds"),
    ({"RestartBudget": -1}, "RestartBudget"),
    ({"RestartWindowSeconds": "x"}, "RestartWindowSeconds"),
    ({"ProxyMaxInFlight": 0}, "ProxyMaxInFlight"),
    ({"ProxyUpstreamIdleTimeoutSeconds": -5}, "ProxyUpstreamIdleTimeoutSeconds"),
    ({"HealthCheckIntervalSeconds": 0}, "HealthCheckIntervalSeconds"),
    ({"ShutdownTimeoutSeconds": None}, "ShutdownTimeoutSeconds"),
    ({"StopInstancesOnShutdown": "yes"}, "StopInstancesOnShutdown"),
    ({"LogLevel": "LOUD"}, "LogLevel"),
    ({"Colour": "blue"}, "Colour"),
]


@pytest.mark.parametrize(("patch", "field"), BAD_FIELDS)
def test_bad_field_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], patch: dict[str, Any], field: str
) -> None:
    path = write(tmp_path, {**minimal(tmp_path), **patch})
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert info.value.field == field
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"agent: {path}: {field}: "), err


def test_required_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, {"NodeId": "n1"}), environ={})
    assert info.value.field == "StateDirectory"
    assert "MIRBAD_AGENT_STATE_DIRECTORY" in str(info.value)


@pytest.mark.parametrize(
    ("content", "needle"),
    [("{not json", "invalid JSON at line 1"), ("[1, 2]", "one JSON object")],
)
def test_invalid_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, needle: str
) -> None:
    path = write(tmp_path, content)
    assert main(["run", "--config", str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--config", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_env_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(tmp_path, Port=9443))
    env = {
        "MIRBAD_AGENT_PORT": "9444",
        "MIRBAD_AGENT_NODE_ID": "from-env",
        "MIRBAD_AGENT_STATE_DIRECTORY": str(tmp_path / "env-state"),
        "MIRBAD_AGENT_BOOTSTRAP_DIRECTORY": str(tmp_path / "boot"),
        "MIRBAD_AGENT_ADDRESSES": '["https://10.1.1.1:9444"]',
        "MIRBAD_AGENT_PROXY_UPSTREAM_IDLE_TIMEOUT_SECONDS": "2.5",
        "MIRBAD_AGENT_STOP_INSTANCES_ON_SHUTDOWN": "true",
    }
    config = load_config(path, environ=env)
    assert config.port == 9444
    assert config.node_id == "from-env"
    assert config.state_directory == tmp_path / "env-state"
    assert config.bootstrap_directory == tmp_path / "boot"
    assert config.addresses == ("https://10.1.1.1:9444",)
    assert config.proxy_upstream_idle_timeout_seconds == 2.5
    assert config.stop_instances_on_shutdown is True
    # An empty value nulls a nullable key.
    config = load_config(path, environ={"MIRBAD_AGENT_BOOTSTRAP_DIRECTORY": ""})
    assert config.bootstrap_directory is None


@pytest.mark.parametrize(
    ("var", "value", "field"),
    [
        ("MIRBAD_AGENT_PORT", "abc", "Port"),
        ("MIRBAD_AGENT_ADDRESSES", "[not json", "Addresses"),
        ("MIRBAD_AGENT_NODE_ID", "UPPER", "NodeId"),
    ],
)
def test_bad_env_value_names_field_and_variable(
    tmp_path: Path, var: str, value: str, field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, minimal(tmp_path)), environ={var: value})
    assert info.value.field == field
    assert var in str(info.value)


def test_env_names() -> None:
    assert env_name("NodeId") == "MIRBAD_AGENT_NODE_ID"
    assert env_name("ProxyUpstreamIdleTimeoutSeconds") == (
        "MIRBAD_AGENT_PROXY_UPSTREAM_IDLE_TIMEOUT_SECONDS"
    )


def test_cli_process_exit_code(tmp_path: Path) -> None:
    """The real entry point, as a service manager would run it."""
    path = write(tmp_path, {**minimal(tmp_path), "Port": "nope"})
    done = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f'agent: {path}: Port: "nope" is not an integer; set a whole number from 0 to 65535'
    )


def test_engine_env_allow_from_file_and_environment(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(tmp_path, EngineEnvAllow=["OMP_PROC_BIND"]))
    assert load_config(path, environ={}).engine_env_allow == ("OMP_PROC_BIND",)
    env = {"MIRBAD_AGENT_ENGINE_ENV_ALLOW": '["GGML_VK_VISIBLE_DEVICES"]'}
    assert load_config(path, environ=env).engine_env_allow == ("GGML_VK_VISIBLE_DEVICES",)
    assert load_config(write(tmp_path, minimal(tmp_path)), environ={}).engine_env_allow == ()


@pytest.mark.parametrize("name", ["LD_PRELOAD", "PATH", "LLAMA_API_KEY", "LLAMA_ARG_HOST", "lower"])
def test_engine_env_allow_refuses_guardrail_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, minimal(tmp_path, EngineEnvAllow=[name])), environ={})
    assert info.value.field == "EngineEnvAllow"
    assert repr(name) in str(info.value)
