"""Launch specs: parsing, guardrails, model path confinement and the fingerprint.

The master builds every argv; the agent still refuses anything that would let a spec
escape its guardrails: listening anywhere but loopback, on a port the agent did not
pick, with an API key or log file of its own, or loading a file outside the models
root. A malformed body is 400 invalid_request; a well-formed spec that breaks a rule is
422 spec_rejected. Both name the field or argument at fault.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._errors import InvalidRequest, SpecRejected

__all__ = [
    "INSTANCE_ID_RE",
    "LaunchSpec",
    "check_args",
    "check_env",
    "fingerprint",
    "parse_launch_spec",
    "resolve_model_path",
    "substitute",
]

INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
FOLDER_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
MODEL_PLACEHOLDER = "{model}"
PORT_PLACEHOLDER = "{port}"
LOOPBACK = "127.0.0.1"
# Flags whose value the agent owns; llama-server takes the last value of a repeated
# flag, so one of these anywhere in argv would override what the agent set up.
_REFUSED_FLAGS = ("--api-key", "--api-key-file", "--log-file")
_ALIAS_FLAGS = ("--alias", "-a")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Variables the agent sets itself, and the dynamic loader's, which would let a spec run
# foreign code inside the engine.
_RESERVED_ENV = {"LLAMA_API_KEY", "PATH", "HOME", "LANG"}
_RESERVED_ENV_PREFIXES = ("LD_", "LLAMA_ARG_")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """A parsed POST /instances body."""

    instance_id: str
    model_id: int | str | None
    served_name: str
    runtime: str
    delivery: str
    executable_name: str
    executable_version: str | None
    model_folder: str
    model_file: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def to_json(self) -> dict[str, Any]:
        """The spec as the master sent it (normalised), for persistence and comparison."""
        return {
            "instanceId": self.instance_id,
            "modelId": self.model_id,
            "servedName": self.served_name,
            "runtime": self.runtime,
            "delivery": self.delivery,
            "executable": {"name": self.executable_name, "version": self.executable_version},
            "model": {"folder": self.model_folder, "file": self.model_file},
            "args": list(self.args),
            "env": dict(self.env),
        }


def _require_str(body: dict[str, Any], key: str, where: str = "") -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"field '{where}{key}' is required and must be a non-empty string")
    return value


def _require_object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if not isinstance(value, dict):
        raise InvalidRequest(f"field '{key}' is required and must be an object")
    return value


def parse_launch_spec(body: Any) -> LaunchSpec:
    """Check the shape of a launch body; raises InvalidRequest naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    instance_id = _require_str(body, "instanceId")
    if not INSTANCE_ID_RE.fullmatch(instance_id):
        raise InvalidRequest("field 'instanceId' must match ^[A-Za-z0-9._-]{1,64}$")
    model_id = body.get("modelId")
    if isinstance(model_id, bool) or not isinstance(model_id, int | str | None):
        raise InvalidRequest("field 'modelId' must be an integer, a string or null")
    served_name = _require_str(body, "servedName")
    runtime = _require_str(body, "runtime")
    delivery = _require_str(body, "delivery")
    executable = _require_object(body, "executable")
    exe_name = _require_str(executable, "name", "executable.")
    exe_version = executable.get("version")
    if exe_version is not None and (not isinstance(exe_version, str) or not exe_version):
        raise InvalidRequest("field 'executable.version' must be a non-empty string or null")
    model = _require_object(body, "model")
    folder = _require_str(model, "folder", "model.")
    file = _require_str(model, "file", "model.")
    args = body.get("args")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidRequest("field 'args' must be a list of strings")
    env = body.get("env", {})
    if env is None:
        env = {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise InvalidRequest("field 'env' must be an object of string values")
    return LaunchSpec(
        instance_id=instance_id,
        model_id=model_id,
        served_name=served_name,
        runtime=runtime,
        delivery=delivery,
        executable_name=exe_name,
        executable_version=exe_version,
        model_folder=folder,
        model_file=file,
        args=tuple(args),
        env=tuple(sorted(env.items())),
    )


def check_runtime(spec: LaunchSpec) -> None:
    """Refuse runtimes and deliveries this agent does not offer."""
    if spec.runtime != "llamacpp":
        raise SpecRejected(
            f"runtime {spec.runtime!r} is not offered by this agent (only 'llamacpp')"
        )
    if spec.delivery != "process":
        raise SpecRejected(
            f"delivery {spec.delivery!r} is not offered by this agent (only 'process')"
        )


def check_args(args: tuple[str, ...]) -> str:
    """Enforce the argv guardrails; returns the ``--alias`` value the Ready check needs."""
    alias: str | None = None
    port_seen = False
    index = 0
    while index < len(args):
        arg = args[index]
        nxt = args[index + 1] if index + 1 < len(args) else None
        flag, has_eq, inline = arg.partition("=")
        if flag.startswith("--") and any(flag == f or flag.startswith(f) for f in _REFUSED_FLAGS):
            raise SpecRejected(f"argument {index} ({flag}) is refused: the agent sets it itself")
        if flag == "--host":
            value = inline if has_eq else nxt
            if value != LOOPBACK:
                raise SpecRejected(
                    f"argument {index} (--host {value}) is refused: engines listen on {LOOPBACK} only"
                )
            index += 1 if has_eq else 2
            continue
        if flag == "--port":
            if has_eq or nxt != PORT_PLACEHOLDER:
                raise SpecRejected(
                    f"argument {index} (--port) is refused: the only allowed form is "
                    f"'--port {PORT_PLACEHOLDER}' (the agent picks the port)"
                )
            port_seen = True
            index += 2
            continue
        if flag in _ALIAS_FLAGS:
            value = inline if has_eq else nxt
            if not value:
                raise SpecRejected(f"argument {index} ({flag}) has no value")
            alias = value
            index += 1 if has_eq else 2
            continue
        if arg not in (MODEL_PLACEHOLDER, PORT_PLACEHOLDER) and (
            MODEL_PLACEHOLDER in arg or PORT_PLACEHOLDER in arg
        ):
            raise SpecRejected(
                f"argument {index} ({arg!r}) uses a placeholder inside a longer argument; "
                "{model} and {port} must be whole arguments"
            )
        if arg == PORT_PLACEHOLDER:
            raise SpecRejected(f"argument {index} ({{port}}) may only follow --port")
        index += 1
    if not port_seen:
        raise SpecRejected(
            f"args must contain '--port {PORT_PLACEHOLDER}' (the agent picks the port)"
        )
    if alias is None:
        raise SpecRejected("args must set --alias: the Ready check looks for it in /v1/models")
    return alias


def check_env(env: tuple[tuple[str, str], ...]) -> None:
    """Refuse variables the agent owns and the loader's, which could inject code."""
    for name, _value in env:
        if not _ENV_NAME_RE.fullmatch(name):
            raise SpecRejected(f"env name {name!r} is not a valid variable name")
        if name in _RESERVED_ENV or name.startswith(_RESERVED_ENV_PREFIXES):
            raise SpecRejected(
                f"env {name} is refused: the agent sets it itself, or it could override a "
                "guardrail (set engine options in args)"
            )


def resolve_model_path(models_root: Path, folder: str, file: str) -> Path:
    """The confined, resolved path of ``folder/file`` under the models root.

    Symlinks are followed and the result must still lie inside the resolved root,
    compared by path components (``/srv/models2`` is not inside ``/srv/models``).
    """
    if not FOLDER_RE.fullmatch(folder) or folder in (".", ".."):
        raise SpecRejected(
            f"model.folder {folder!r} must match ^[A-Za-z0-9._-]{{1,200}}$ and not be . or .."
        )
    if file in (".", "..") or "/" in file or "\\" in file or "\x00" in file or len(file) > 255:
        raise SpecRejected(f"model.file {file!r} must be a plain file name")
    try:
        root = models_root.resolve(strict=True)
    except OSError:
        raise SpecRejected(f"the models root {models_root} does not exist on this node") from None
    try:
        resolved = (root / folder / file).resolve(strict=True)
    except FileNotFoundError:
        raise SpecRejected(
            f"model file {folder}/{file} does not exist under the models root {models_root}"
        ) from None
    except (OSError, RuntimeError) as exc:
        raise SpecRejected(f"model file {folder}/{file} cannot be resolved: {exc}") from None
    if resolved.parts[: len(root.parts)] != root.parts:
        raise SpecRejected(
            f"model file {folder}/{file} resolves to {resolved}, outside the models root {root}"
        )
    if not resolved.is_file():
        raise SpecRejected(f"model file {folder}/{file} is not a regular file")
    return resolved


def substitute(args: tuple[str, ...], *, model_path: Path, port: int) -> list[str]:
    """Replace the whole-argument placeholders with the resolved path and the port."""
    out: list[str] = []
    for arg in args:
        if arg == MODEL_PLACEHOLDER:
            out.append(str(model_path))
        elif arg == PORT_PLACEHOLDER:
            out.append(str(port))
        else:
            out.append(arg)
    return out


def fingerprint(spec: LaunchSpec, executable_version: str) -> str:
    """``sha256:`` + hex SHA-256 of canonical JSON of argv, executable version, env names.

    Placeholders stay unsubstituted, so the fingerprint depends only on what the master
    asked for, not on the port picked or where the models root lives.
    """
    # The same formula as the master's models_registry.llamacpp.execution_fingerprint,
    # so the two sides can compare fingerprints (docs/agent-api.md spells it out).
    payload = json.dumps(
        {
            "argv": list(spec.args),
            "executable": executable_version,
            "env": sorted(name for name, _ in spec.env),
        },
        separators=(",", ":"),
        sort_keys=True,
    )
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()
