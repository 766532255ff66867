"""The agent's configuration: one JSON file plus ``MIRBAD_AGENT_*`` overrides.

The file is a flat JSON object with PascalCase keys (``NodeId``, ``Port`` ...). Every
key can be overridden by an environment variable named ``MIRBAD_AGENT_`` plus the key
in UPPER_SNAKE case (``MIRBAD_AGENT_PORT=9444``); list and object values are JSON text
there, and an empty value sets a nullable key to null. Relative paths in the file are
resolved against the file's directory, relative paths from the environment against the
working directory.

Everything is validated when the file is loaded, so a wrong value stops the agent at
start with a message naming the field instead of failing later in the middle of a
launch. Unknown keys are errors because a misspelt key silently falling back to a
default is the worst kind of configuration bug.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agent._errors import ConfigError
from protocol.http_limits import HttpLimits
from protocol.images import DIGEST_RE
from protocol.names import node_id_problem

__all__ = [
    "ENV_PREFIX",
    "AgentConfig",
    "ExecutableEntry",
    "env_name",
    "load_config",
    "normalize_address",
    "validate_node_id",
]

ENV_PREFIX = "MIRBAD_AGENT_"
_EXECUTABLE_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ARCHIVE_MAX_MEMBERS = 50_000
ARCHIVE_MAX_BYTES = 2 * 1024**3


@dataclass(frozen=True, kw_only=True)
class ExecutableEntry:
    """One launchable engine build: a logical name, its version and the binary's path."""

    name: str
    version: str
    path: Path
    default: bool = False


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """The validated agent configuration (see the module docstring for the sources)."""

    node_id: str
    state_directory: Path
    listen_address: str = "127.0.0.1"
    port: int = 9443
    models_root: Path | None = None
    bootstrap_directory: Path | None = None
    bootstrap_wait_seconds: float = 600.0
    addresses: tuple[str, ...] = ()
    executables: tuple[ExecutableEntry, ...] = ()
    port_range_start: int = 8101
    port_range_end: int = 65535
    process_start_timeout_seconds: float = 600.0
    restart_budget: int = 2
    restart_window_seconds: float = 600.0
    proxy_max_in_flight: int = 512
    proxy_upstream_idle_timeout_seconds: float = 1200.0
    health_check_interval_seconds: float = 5.0
    shutdown_timeout_seconds: float = 30.0
    stop_instances_on_shutdown: bool = False
    docker_expected: bool = False
    docker_endpoint: str = "unix:///var/run/docker.sock"
    # The container runtime (docs/agent.md, "Containers"): off unless the node says so.
    docker_enabled: bool = False
    docker_call_timeout_seconds: float = 120.0
    docker_startup_timeout_seconds: float = 120.0
    # The models volume as the Docker engine sees it (the agent's ModelsRoot when null:
    # an agent on the host); the cache volume likewise (no cache mount when null).
    models_host_path: Path | None = None
    cache_host_path: Path | None = None
    # A Docker network the engines join, reached at ss-<instanceId>:8000 (an agent that
    # itself runs in a container on that network); null: a port published on 127.0.0.1.
    docker_network: str | None = None
    approved_images: tuple[str, ...] = ()
    allow_tag_pulls: bool = False
    gpus_expected: bool = False
    log_level: str = "INFO"
    # Logs that do not fill the disk (docs/agent.md, "Logs and disk space"): the agent's
    # own file when LogFile is set, and each engine's output file, capped while it runs.
    log_file: Path | None = None
    log_max_bytes: int = 32 * 1024 * 1024
    log_files: int = 3
    engine_log_max_bytes: int = 32 * 1024 * 1024
    engine_log_files: int = 2
    # Free space a download leaves on the models disk (refused up front otherwise).
    download_reserve_bytes: int = 1024**3
    # Extra environment variables this node's operator lets a launch set for its
    # engines, beyond the engine's own allow-list (protocol.engine_flags).
    engine_env_allow: tuple[str, ...] = ()
    # The listener limits (protocol.http_limits; docs/agent.md).
    http_max_head_bytes: int = HttpLimits.max_head_bytes
    http_max_headers: int = HttpLimits.max_headers
    http_head_timeout_seconds: float = HttpLimits.head_timeout_seconds
    http_body_idle_timeout_seconds: float = HttpLimits.body_idle_timeout_seconds
    http_max_connections: int = HttpLimits.max_connections
    # What one archive the agent unpacks (an engine's source build) may hold
    # (agent/engines/_archives.py; docs/agent.md). The llama.cpp source has ~4,100
    # members and ~180 MB: both defaults leave about ten times that.
    archive_max_members: int = ARCHIVE_MAX_MEMBERS
    archive_max_bytes: int = ARCHIVE_MAX_BYTES
    config_file: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # ModelsRoot defaults to a folder of the state directory, which is only known
        # once StateDirectory is; frozen dataclasses need object.__setattr__ for that.
        if self.models_root is None:
            object.__setattr__(self, "models_root", self.state_directory / "models")

    @property
    def http_limits(self) -> HttpLimits:
        """The listener limits as ``protocol.http_limits`` takes them."""
        return HttpLimits(
            max_head_bytes=self.http_max_head_bytes,
            max_headers=self.http_max_headers,
            head_timeout_seconds=self.http_head_timeout_seconds,
            body_idle_timeout_seconds=self.http_body_idle_timeout_seconds,
            max_connections=self.http_max_connections,
        )

    @property
    def models_root_path(self) -> Path:
        """ModelsRoot, never None after construction."""
        assert self.models_root is not None
        return self.models_root

    @property
    def enroll_addresses(self) -> list[str]:
        """The addresses sent at enrollment: Addresses, or the listener's own address."""
        if self.addresses:
            return list(self.addresses)
        host = self.listen_address
        if ":" in host:
            host = f"[{host}]"
        return [f"https://{host}:{self.port}"]


def env_name(key: str) -> str:
    """``ProxyMaxInFlight`` -> ``MIRBAD_AGENT_PROXY_MAX_IN_FLIGHT``."""
    return ENV_PREFIX + re.sub(r"(?<!^)(?=[A-Z])", "_", key).upper()


def validate_node_id(value: str) -> str | None:
    """None when ``value`` is a valid node id, else what is wrong with it."""
    return node_id_problem(value)


def normalize_address(value: str, port: int) -> str:
    """Turn ``host``, ``host:port`` or ``https://host:port`` into an https URL.

    Raises ValueError naming what is wrong.
    """
    text = value.strip()
    if not text:
        raise ValueError("an address must not be empty")
    if "://" not in text:
        text = "https://" + text
    parts = urlsplit(text)
    if parts.scheme != "https":
        raise ValueError(f"{value!r} must be an https:// URL (the agent only serves TLS)")
    if not parts.hostname:
        raise ValueError(f"{value!r} has no host name")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{value!r} must be scheme, host and port only")
    try:
        explicit_port = parts.port
    except ValueError as exc:
        raise ValueError(f"{value!r} has an invalid port") from exc
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{explicit_port or port}"


class _Source:
    """Where one value came from, so an error can say it."""

    def __init__(self, *, key: str, env_var: str | None, base_dir: Path) -> None:
        self.key = key
        self.env_var = env_var
        self.base_dir = base_dir

    def fail(self, what: str, fix: str) -> ConfigError:
        subject = f"{self.env_var} ({what})" if self.env_var else what
        return ConfigError(f"{subject}; {fix}", field=self.key)


def _describe(value: Any) -> str:
    return "null" if value is None else json.dumps(value)[:80]


def _int(low: int, high: int) -> Callable[[Any, _Source], int]:
    def parse(value: Any, src: _Source) -> int:
        if src.env_var and isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise src.fail(
                    f"{value!r} is not an integer", f"set a whole number from {low} to {high}"
                ) from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise src.fail(
                f"{_describe(value)} is not an integer", f"set a whole number from {low} to {high}"
            )
        if not low <= value <= high:
            raise src.fail(f"{value} is out of range", f"set a whole number from {low} to {high}")
        return value

    return parse


def _seconds(*, allow_zero: bool) -> Callable[[Any, _Source], float]:
    bound = "0 or more" if allow_zero else "more than 0"

    def parse(value: Any, src: _Source) -> float:
        if src.env_var and isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise src.fail(
                    f"{value!r} is not a number", f"set a number of seconds, {bound}"
                ) from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise src.fail(
                f"{_describe(value)} is not a number", f"set a number of seconds, {bound}"
            )
        number = float(value)
        if number != number or number in (float("inf"), float("-inf")):
            raise src.fail(f"{value} is not finite", f"set a number of seconds, {bound}")
        if number < 0 or (number == 0 and not allow_zero):
            raise src.fail(f"{value} is too small", f"set a number of seconds, {bound}")
        return number

    return parse


def _string(value: Any, src: _Source) -> str:
    if not isinstance(value, str) or not value.strip():
        raise src.fail(f"{_describe(value)} is not a non-empty string", "set a text value")
    return value.strip()


def _node_id(value: Any, src: _Source) -> str:
    text = _string(value, src)
    problem = validate_node_id(text)
    if problem:
        raise src.fail(problem, "it must equal the node id the master enrolled")
    return text


def _resolve_path(text: str, src: _Source) -> Path:
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (Path.cwd() if src.env_var else src.base_dir) / path
    return Path(os.path.normpath(path))


def _path(value: Any, src: _Source) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise src.fail(f"{_describe(value)} is not a path", "set a directory path as a string")
    return _resolve_path(value.strip(), src)


def _optional_path(value: Any, src: _Source) -> Path | None:
    if value is None or (src.env_var and isinstance(value, str) and value.strip() in ("", "null")):
        return None
    return _path(value, src)


def _listen_address(value: Any, src: _Source) -> str:
    text = _string(value, src)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise src.fail(
            f"{text!r} is not an IP address", "set an IP such as 127.0.0.1, 0.0.0.0 or ::"
        ) from None


def _json_from_env(value: Any, src: _Source) -> Any:
    if src.env_var and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise src.fail(
                f"is not valid JSON ({exc.msg})", "give the value as JSON text"
            ) from None
    return value


def _addresses(value: Any, src: _Source) -> tuple[str, ...]:
    # Normalised against Port later, once Port is known; here only the shape is checked.
    value = _json_from_env(value, src)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise src.fail(
            f"{_describe(value)} is not a list of strings", 'set e.g. ["https://10.0.0.5:9443"]'
        )
    return tuple(value)


_ENV_VAR_RE = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
# The agent's own variables and the loader's; llama-server reads LLAMA_ARG_* as flags.
_NEVER_ENGINE_ENV = ("PATH", "HOME", "LANG", "LLAMA_API_KEY", "CUDA_VISIBLE_DEVICES")
_NEVER_ENGINE_ENV_PREFIXES = ("LD_", "LLAMA_ARG_")


def _engine_env_allow(value: Any, src: _Source) -> tuple[str, ...]:
    value = _json_from_env(value, src)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise src.fail(f"{_describe(value)} is not a list of strings", 'set e.g. ["OMP_PROC_BIND"]')
    for name in value:
        if not _ENV_VAR_RE.fullmatch(name):
            raise src.fail(
                f"{name!r} is not a variable name", "use upper-case letters, digits and '_'"
            )
        if name in _NEVER_ENGINE_ENV or name.startswith(_NEVER_ENGINE_ENV_PREFIXES):
            raise src.fail(
                f"{name!r} may not be set by a launch: the agent sets it, or it would override "
                "a guardrail",
                "remove it",
            )
    return tuple(value)


def _approved_images(value: Any, src: _Source) -> tuple[str, ...]:
    value = _json_from_env(value, src)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise src.fail(f"{_describe(value)} is not a list of strings", 'set e.g. ["sha256:..."]')
    for digest in value:
        if not DIGEST_RE.fullmatch(digest):
            raise src.fail(
                f"{digest!r} is not an image digest",
                "use sha256: and 64 lower-case hex digits (docker images --digests)",
            )
    return tuple(value)


_DOCKER_NETWORK_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _docker_network(value: Any, src: _Source) -> str | None:
    if value is None or value == "":
        return None
    text = _string(value, src)
    if not _DOCKER_NETWORK_RE.fullmatch(text):
        raise src.fail(f"{text!r} is not a Docker network name", "use letters, digits, _ . -")
    return text


def _bool(value: Any, src: _Source) -> bool:
    if src.env_var and isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise src.fail(f"{value!r} is not a boolean", "set true or false")
    if not isinstance(value, bool):
        raise src.fail(f"{_describe(value)} is not true or false", "set true or false")
    return value


def _log_level(value: Any, src: _Source) -> str:
    text = _string(value, src).upper()
    if text not in _LOG_LEVELS:
        raise src.fail(f"{text!r} is not a log level", "use one of " + ", ".join(_LOG_LEVELS))
    return text


_EXECUTABLE_KEYS = {"Name", "Version", "Path", "Default"}


def _executables(value: Any, src: _Source) -> tuple[ExecutableEntry, ...]:
    value = _json_from_env(value, src)
    example = '[{"Name": "llama.cpp", "Version": "0.6.0-dev", "Path": "/opt/.../llama-server", "Default": true}]'
    if not isinstance(value, list):
        raise src.fail(f"{_describe(value)} is not a list", f"set a list like {example}")
    entries: list[ExecutableEntry] = []
    for index, item in enumerate(value):
        where = f"entry {index}"
        if not isinstance(item, dict):
            raise src.fail(f"{where} is not an object", f"set a list like {example}")
        unknown = sorted(set(item) - _EXECUTABLE_KEYS)
        if unknown:
            raise src.fail(
                f"{where} has unknown key(s) {', '.join(unknown)}",
                "use Name, Version, Path, Default",
            )
        for required in ("Name", "Version", "Path"):
            if not isinstance(item.get(required), str) or not item[required].strip():
                raise src.fail(
                    f"{where}: {required} is missing or not a string", f"set a list like {example}"
                )
        name = item["Name"].strip()
        if not _EXECUTABLE_NAME_RE.fullmatch(name):
            raise src.fail(
                f"{where}: Name {name!r} is not a valid name", "use letters, digits, '.', '_', '-'"
            )
        default = item.get("Default", False)
        if not isinstance(default, bool):
            raise src.fail(f"{where}: Default is not true or false", "set Default to true or false")
        path = _resolve_path(item["Path"].strip(), src)
        entries.append(
            ExecutableEntry(name=name, version=item["Version"].strip(), path=path, default=default)
        )
    seen: set[tuple[str, str]] = set()
    for entry in entries:
        if (entry.name, entry.version) in seen:
            raise src.fail(
                f"{entry.name} {entry.version} is listed twice", "list each version once"
            )
        seen.add((entry.name, entry.version))
    for name in {e.name for e in entries}:
        same = [e for e in entries if e.name == name]
        defaults = [e for e in same if e.default]
        if len(defaults) > 1:
            raise src.fail(
                f"several {name!r} entries have Default: true", "mark exactly one as the default"
            )
        if not defaults and len(same) > 1:
            raise src.fail(
                f"several {name!r} entries and none has Default: true", "mark one as the default"
            )
    return tuple(entries)


def _docker_endpoint(value: Any, src: _Source) -> str:
    if not isinstance(value, str) or not value.startswith(("unix://", "tcp://", "npipe://")):
        raise src.fail(f"{value!r} is not a Docker endpoint", "use unix://, tcp:// or npipe://")
    return value


def _default_node_id(var: str) -> str:
    """Without NodeId the node is named after its host name, lower-cased."""
    import socket

    name = socket.gethostname().split(".")[0].lower()
    if validate_node_id(name) is not None:
        raise ConfigError(
            f"is not set and the host name {name!r} is not a valid node id; set NodeId "
            f"(or {var}) to lower-case letters, digits and '-'",
            field="NodeId",
        )
    return name


# Key -> (dataclass attribute, parser). Order matters only for error precedence.
_FIELDS: dict[str, tuple[str, Callable[[Any, _Source], Any]]] = {
    "NodeId": ("node_id", _node_id),
    "StateDirectory": ("state_directory", _path),
    "ListenAddress": ("listen_address", _listen_address),
    "Port": ("port", _int(0, 65535)),
    "ModelsRoot": ("models_root", _optional_path),
    "BootstrapDirectory": ("bootstrap_directory", _optional_path),
    "BootstrapWaitSeconds": ("bootstrap_wait_seconds", _seconds(allow_zero=True)),
    "Addresses": ("addresses", _addresses),
    "Executables": ("executables", _executables),
    "PortRangeStart": ("port_range_start", _int(1, 65535)),
    "PortRangeEnd": ("port_range_end", _int(1, 65535)),
    "ProcessStartTimeoutSeconds": ("process_start_timeout_seconds", _seconds(allow_zero=False)),
    "RestartBudget": ("restart_budget", _int(0, 1000)),
    "RestartWindowSeconds": ("restart_window_seconds", _seconds(allow_zero=False)),
    "ProxyMaxInFlight": ("proxy_max_in_flight", _int(1, 1_000_000)),
    "ProxyUpstreamIdleTimeoutSeconds": (
        "proxy_upstream_idle_timeout_seconds",
        _seconds(allow_zero=True),
    ),
    "HealthCheckIntervalSeconds": ("health_check_interval_seconds", _seconds(allow_zero=False)),
    "ShutdownTimeoutSeconds": ("shutdown_timeout_seconds", _seconds(allow_zero=True)),
    "StopInstancesOnShutdown": ("stop_instances_on_shutdown", _bool),
    "DockerExpected": ("docker_expected", _bool),
    "DockerEndpoint": ("docker_endpoint", _docker_endpoint),
    "DockerEnabled": ("docker_enabled", _bool),
    "DockerCallTimeoutSeconds": ("docker_call_timeout_seconds", _seconds(allow_zero=False)),
    "DockerStartupTimeoutSeconds": (
        "docker_startup_timeout_seconds",
        _seconds(allow_zero=True),
    ),
    "ModelsHostPath": ("models_host_path", _optional_path),
    "CacheHostPath": ("cache_host_path", _optional_path),
    "DockerNetwork": ("docker_network", _docker_network),
    "ApprovedImages": ("approved_images", _approved_images),
    "AllowTagPulls": ("allow_tag_pulls", _bool),
    "GpusExpected": ("gpus_expected", _bool),
    "LogLevel": ("log_level", _log_level),
    "LogFile": ("log_file", _optional_path),
    "LogMaxBytes": ("log_max_bytes", _int(64 * 1024, 2**40)),
    "LogFiles": ("log_files", _int(1, 100)),
    "EngineLogMaxBytes": ("engine_log_max_bytes", _int(64 * 1024, 2**40)),
    "EngineLogFiles": ("engine_log_files", _int(0, 100)),
    "DownloadReserveBytes": ("download_reserve_bytes", _int(0, 2**50)),
    "EngineEnvAllow": ("engine_env_allow", _engine_env_allow),
    "HttpMaxHeadBytes": ("http_max_head_bytes", _int(1024, 16 * 1024 * 1024)),
    "HttpMaxHeaders": ("http_max_headers", _int(8, 10_000)),
    "HttpHeadTimeoutSeconds": ("http_head_timeout_seconds", _seconds(allow_zero=False)),
    "HttpBodyIdleTimeoutSeconds": ("http_body_idle_timeout_seconds", _seconds(allow_zero=False)),
    "HttpMaxConnections": ("http_max_connections", _int(1, 1_000_000)),
    "ArchiveMaxMembers": ("archive_max_members", _int(1, 10_000_000)),
    "ArchiveMaxBytes": ("archive_max_bytes", _int(1024**2, 2**40)),
}
_REQUIRED = ("StateDirectory",)


def load_config(
    path: str | os.PathLike[str], environ: Mapping[str, str] | None = None
) -> AgentConfig:
    """Read, merge and validate the config file and the environment overrides.

    Raises ConfigError whose ``file`` is the config path and whose ``field`` is the
    offending key; ``str(error)`` is the ``<file>: <Field>: <message>`` line the CLI
    prints.
    """
    env = os.environ if environ is None else environ
    file_path = Path(path)
    try:
        raw = json.loads(file_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            "the config file does not exist; create it or pass --config", file=str(path)
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the config file ({exc.strerror})", file=str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("the config file is not UTF-8 text", file=str(path)) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", file=str(path)
        ) from None
    try:
        return _build(raw, env, file_path)
    except ConfigError as exc:
        exc.file = str(path)
        exc.args = (f"{path}: {exc.args[0]}",)
        raise


def _build(raw: Any, env: Mapping[str, str], file_path: Path) -> AgentConfig:
    if not isinstance(raw, dict):
        raise ConfigError("the config file must hold one JSON object of Key: value pairs")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        key = unknown[0]
        raise ConfigError(
            f"unknown key; the known keys are {', '.join(_FIELDS)} (check the spelling)", field=key
        )
    base_dir = file_path.resolve().parent
    values: dict[str, Any] = {}
    for key, (attr, parser) in _FIELDS.items():
        var = env_name(key)
        if var in env:
            values[attr] = parser(env[var], _Source(key=key, env_var=var, base_dir=base_dir))
        elif key in raw:
            values[attr] = parser(raw[key], _Source(key=key, env_var=None, base_dir=base_dir))
        elif key in _REQUIRED:
            raise ConfigError(f"is required; set it in the file or with {var}", field=key)
        elif key == "NodeId":
            values[attr] = _default_node_id(var)
    start = values.get("port_range_start", 8101)
    end = values.get("port_range_end", 65535)
    if start > end:
        raise ConfigError(
            f"PortRangeStart {start} is above PortRangeEnd {end}; make the range non-empty",
            field="PortRangeEnd",
        )
    port = values.get("port", 9443)
    normalized: list[str] = []
    for address in values.get("addresses", ()):
        try:
            normalized.append(normalize_address(address, port))
        except ValueError as exc:
            var = env_name("Addresses")
            prefix = f"{var}: " if var in env else ""
            raise ConfigError(f"{prefix}{exc}", field="Addresses") from None
    values["addresses"] = tuple(normalized)
    return AgentConfig(**values, config_file=file_path)
