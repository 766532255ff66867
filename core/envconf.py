"""Typed parsers for the ``MIRBAD_*`` environment variables.

Every setting of the master is read through one of these helpers so that a
missing or malformed value stops the process at start with the variable's
name and what to do, instead of surfacing later as an odd failure. Secrets may
also come from ``<NAME>_FILE`` (a path whose content is the value), which is how
Docker and systemd hand secrets to a process without putting them in the
environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit


class SettingError(ValueError):
    """A ``MIRBAD_*`` variable is malformed; the message names it."""


def _raw(name: str, env: Mapping[str, str] | None) -> str | None:
    source = os.environ if env is None else env
    value = source.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def env_str(name: str, default: str | None = None, *, env: Mapping[str, str] | None = None) -> str:
    value = _raw(name, env)
    if value is None:
        if default is None:
            raise SettingError(f"{name} is required but not set.")
        return default
    return value


def env_int(
    name: str,
    default: int,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    value = _raw(name, env)
    if value is None:
        return default
    try:
        number = int(value, 10)
    except ValueError:
        raise SettingError(f"{name}: expected a whole number, got {value!r}.") from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        low = "-inf" if minimum is None else str(minimum)
        high = "inf" if maximum is None else str(maximum)
        raise SettingError(f"{name}: {number} is out of range; use a value from {low} to {high}.")
    return number


def env_port(name: str, default: int, *, env: Mapping[str, str] | None = None) -> int:
    return env_int(name, default, minimum=1, maximum=65535, env=env)


def env_float(
    name: str, default: float, *, minimum: float | None = None, env: Mapping[str, str] | None = None
) -> float:
    value = _raw(name, env)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise SettingError(f"{name}: expected a number, got {value!r}.") from None
    if number != number or (minimum is not None and number < minimum):  # NaN or too small
        raise SettingError(f"{name}: {value!r} is out of range; use a number >= {minimum}.")
    return number


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, default: bool, *, env: Mapping[str, str] | None = None) -> bool:
    value = _raw(name, env)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise SettingError(f"{name}: expected true or false, got {value!r}.")


def env_list(name: str, default: list[str], *, env: Mapping[str, str] | None = None) -> list[str]:
    value = _raw(name, env)
    if value is None:
        return list(default)
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        raise SettingError(f"{name}: empty item in the comma-separated list {value!r}.")
    return items


def env_path(name: str, default: str, *, env: Mapping[str, str] | None = None) -> Path:
    value = _raw(name, env) or default
    if "\x00" in value:
        raise SettingError(f"{name}: the path contains a NUL byte.")
    return Path(value).expanduser().resolve()


def env_url(
    name: str,
    default: str | None,
    *,
    schemes: tuple[str, ...],
    env: Mapping[str, str] | None = None,
) -> str | None:
    value = _raw(name, env)
    if value is None:
        return default
    parts = urlsplit(value)
    if parts.scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in schemes)
        raise SettingError(f"{name}: {value!r} must start with one of {allowed}.")
    if parts.scheme not in ("sqlite", "unix", "redis+socket") and not parts.hostname:
        raise SettingError(f"{name}: {value!r} has no host name.")
    try:
        parts.port  # noqa: B018 - property raises on a bad port
    except ValueError:
        raise SettingError(f"{name}: {value!r} has an invalid port.") from None
    return value


def env_secret(name: str, *, env: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name``, or the content of the file named by ``name_FILE``."""
    direct = _raw(name, env)
    file_name = _raw(f"{name}_FILE", env)
    if direct is not None and file_name is not None:
        raise SettingError(f"{name} and {name}_FILE are both set; set only one.")
    if direct is not None:
        return direct
    if file_name is None:
        return None
    try:
        content = Path(file_name).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SettingError(f"{name}_FILE: cannot read {file_name!r}: {exc.strerror}.") from None
    if not content:
        raise SettingError(f"{name}_FILE: {file_name!r} is empty.")
    return content
