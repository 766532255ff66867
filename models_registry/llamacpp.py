"""Typed llama.cpp settings and the one argv builder for llama-server.

The master's builder is the only code that builds llama-server's argv. The
argv order is fixed so the execution fingerprint is stable: the same settings
always give the same argv, byte for byte. Extra args and the chat template are
checked against the engine's flag allow-list (protocol.engine_flags, which the
agent checks every launch against again): only the operator flags it names,
each with a value of its shape. A flag that is a typed setting or set by the
system is refused in extra args (llama-server takes the last value of a
repeated flag, and admission computed the memory budget from the typed value).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from core.errors import ServiceError
from protocol.engine_flags import (
    LOOPBACK,
    MODEL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    FlagRefused,
    check_chat_template,
    check_extra_args,
    listen_host,
)

ENGINE = "llamacpp"
T = TypeVar("T")

ALWAYS_FLAGS = [
    "--host", LOOPBACK,
    "--port", PORT_PLACEHOLDER,
    "--metrics",
    "--no-ui",
    "--cache-ram", "0",
    "--fit", "off",
]  # fmt: skip

FLASH_ATTENTION = ("on", "off", "auto")
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
POOLING = ("none", "mean", "cls", "last", "rank")
REASONING = ("on", "off", "auto")
JINJA_SWITCHES = ("--jinja", "--no-jinja")


class SettingsError(ValueError):
    """llama.cpp settings are invalid; ``errors`` maps each field to what is wrong."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


@dataclass(frozen=True, kw_only=True)
class LlamaCppSettings:
    """The editor's llama.cpp section (docs/operator-guide.md, "llama.cpp settings")."""

    context_size: int = 4096  # per slot; -c is context_size x parallel
    parallel: int = 1
    gpu_layers: int = 999
    flash_attention: str = "auto"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    batch_size: int | None = None
    ubatch_size: int | None = None
    embedding: bool = False
    # Router-side, not a flag: truncate + renormalise for ``dimensions`` (docs/operator-guide.md, "/v1").
    emulate_dimensions: bool = True
    pooling: str | None = None
    causal_attention: bool = True
    chat_template: str | None = None
    reasoning: str = "auto"
    threads: int | None = None
    extra_args: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LlamaCppSettings:
        """Parse and validate; every bad field is named in :class:`SettingsError`."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        errors: dict[str, str] = {}
        for key in sorted(set(data) - known):
            errors[key] = f"unknown setting; known settings are {', '.join(sorted(known))}"
        values = {k: v for k, v in data.items() if k in known}

        def integer(name: str, low: int, high: int, optional: bool = False) -> None:
            if name not in values:
                return
            value = values[name]
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                errors[name] = "must be a whole number"
            elif not low <= value <= high:
                errors[name] = f"must be between {low} and {high}"

        def choice(name: str, options: tuple[str, ...], optional: bool = False) -> None:
            if name not in values:
                return
            value = values[name]
            if value is None and optional:
                return
            if value not in options:
                errors[name] = f"must be one of {', '.join(options)}"

        integer("context_size", 16, 4_194_304)
        integer("parallel", 1, 256)
        integer("gpu_layers", 0, 999)
        integer("batch_size", 1, 1_048_576, optional=True)
        integer("ubatch_size", 1, 1_048_576, optional=True)
        integer("threads", 1, 1024, optional=True)
        choice("flash_attention", FLASH_ATTENTION)
        choice("cache_type_k", KV_TYPES)
        choice("cache_type_v", KV_TYPES)
        choice("pooling", POOLING, optional=True)
        choice("reasoning", REASONING)
        for name in ("embedding", "causal_attention", "emulate_dimensions"):
            if name in values and not isinstance(values[name], bool):
                errors[name] = "must be true or false"
        template = values.get("chat_template")
        if template is not None:
            problem = _check_template(template)
            if problem:
                errors["chat_template"] = problem
        extra = values.get("extra_args", [])
        if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
            errors["extra_args"] = "must be a list of strings"
        else:
            problem = _check_extra_args(extra)
            if not problem and template is not None:
                problem = _check_jinja_with_template(extra)
            if problem:
                errors["extra_args"] = problem
        if errors:
            raise SettingsError(errors)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def micro_batch(self) -> int | None:
        """-b = -ub for embedding models: set value, else min(ctx, 2048) causal, ctx otherwise."""
        if not self.embedding:
            return self.ubatch_size
        if self.ubatch_size is not None:
            return self.ubatch_size
        return min(self.context_size, 2048) if self.causal_attention else self.context_size


def saved_settings(data: dict[str, Any] | None, *, model: str) -> LlamaCppSettings:
    """A saved model's settings, parsed; 409 llamacpp_settings_invalid naming the field.

    A definition saved before a rule was tightened (issue 11: the flag allow-list)
    can hold settings that are now refused; starting it must say so, not fail.
    """
    return parse_saved(
        LlamaCppSettings.from_dict, data, model=model, code=f"{ENGINE}_settings_invalid"
    )


def parse_saved(
    parse: Callable[[dict[str, Any] | None], T],
    data: dict[str, Any] | None,
    *,
    model: str,
    code: str,
) -> T:
    """Any runtime's saved settings through its ``parse``; 409 ``code`` naming the field."""
    try:
        return parse(data)
    except SettingsError as exc:
        name, problem = next(iter(exc.errors.items()))
        raise ServiceError(
            409,
            code,
            f"Model '{model}': its saved settings.{name} are refused now: {problem}. "
            "Change them (PATCH the model's settings) before starting it.",
            details={"fields": {f"settings.{k}": v for k, v in exc.errors.items()}},
        ) from None


def _check_extra_args(args: list[str]) -> str | None:
    """None when every extra arg is an allowed operator flag or its value, else why not."""
    try:
        check_extra_args(args, engine=ENGINE)
    except FlagRefused as exc:
        return f"argument {exc.index}: {exc.message}"
    return None


def _check_jinja_with_template(args: list[str]) -> str | None:
    """A built-in template comes with ``--no-jinja``, so extra args may not switch Jinja."""
    for arg in args:
        if arg in JINJA_SWITCHES:
            return (
                f"{arg!r} may not be passed with chat_template: a built-in template is "
                "rendered without Jinja (the builder sets --no-jinja); remove one of the two"
            )
    return None


def _check_template(template: object) -> str | None:
    """None for ``builtin:<name>`` with a name of the engine's own list, else why not."""
    if not isinstance(template, str) or not template.startswith("builtin:"):
        return "must be 'builtin:<name>' (a file path or a template text is not accepted)"
    return check_chat_template(template.removeprefix("builtin:"), engine=ENGINE)


def build_argv(
    *,
    settings: LlamaCppSettings,
    served_name: str,
    gpus: int = 0,
    tensor_split: list[int] | None = None,
    delivery: str = "process",
) -> list[str]:
    """The canonical llama-server argv, with ``{model}`` and ``{port}`` left to the agent.

    ``delivery`` decides ``--host``: loopback for a process, every address of its own
    network namespace in a container (protocol.engine_flags.listen_host).

    ``gpus`` is the number of GPUs the placement pins (the agent makes exactly
    those visible, so devices are always CUDA0..N-1 of the renumbered set);
    ``tensor_split`` holds the per-GPU budgets for a multi-GPU placement.
    """
    argv: list[str] = ["-m", MODEL_PLACEHOLDER, "--alias", served_name]
    argv += ["-c", str(settings.context_size * settings.parallel)]
    argv += ["-np", str(settings.parallel)]
    argv += ["-ngl", str(settings.gpu_layers)]
    argv += ["-fa", settings.flash_attention]
    argv += ["-ctk", settings.cache_type_k, "-ctv", settings.cache_type_v]
    if settings.embedding:
        micro = settings.micro_batch()
        argv += ["-b", str(micro), "-ub", str(micro)]
    else:
        if settings.batch_size is not None:
            argv += ["-b", str(settings.batch_size)]
        if settings.ubatch_size is not None:
            argv += ["-ub", str(settings.ubatch_size)]
    if settings.embedding:
        argv += ["--embedding"]
        if settings.pooling:
            argv += ["--pooling", settings.pooling]
    if settings.chat_template:
        # llama-server reads --chat-template as Jinja source while Jinja is on (its
        # default since 0.6): "llama3" would render as the literal word. Built-in
        # names are understood only with Jinja off, set before the flag.
        argv += ["--no-jinja", "--chat-template", settings.chat_template.removeprefix("builtin:")]
    if gpus == 1:
        argv += ["--split-mode", "none", "--device", "CUDA0"]
    elif gpus > 1:
        argv += ["--device", ",".join(f"CUDA{i}" for i in range(gpus))]
        if tensor_split:
            argv += ["--tensor-split", ",".join(str(max(1, b // 2**20)) for b in tensor_split)]
    argv += ["--reasoning", settings.reasoning]
    if settings.threads is not None:
        argv += ["-t", str(settings.threads)]
    argv += ALWAYS_FLAGS if delivery == "process" else _host_for(delivery)
    argv += settings.extra_args
    return argv


def _host_for(delivery: str) -> list[str]:
    """ALWAYS_FLAGS with the ``--host`` of ``delivery``."""
    flags = list(ALWAYS_FLAGS)
    flags[flags.index("--host") + 1] = listen_host(delivery)
    return flags


def execution_fingerprint(*, argv: list[str], executable_version: str, env_names: list[str]) -> str:
    """What decides "restart pending": canonical argv, engine version, environment names."""
    payload = json.dumps(
        {"argv": argv, "executable": executable_version, "env": sorted(env_names)},
        separators=(",", ":"),
        sort_keys=True,
    )
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()
