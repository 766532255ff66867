"""Typed vLLM settings and the one argv builder for ``vllm serve`` (in a container).

vLLM runs only in a container, from the official ``vllm/vllm-openai`` image whose
entrypoint is ``vllm serve``: the argv built here is what follows it, the model
first (``{model}``, its path inside the read-only models mount), then flags. The
engine's key comes from ``VLLM_API_KEY``, which the agent sets (never in argv).

As for llama.cpp (models_registry/llamacpp.py), the order is fixed so the same
settings always give the same argv, and every value is checked against the
engine's flag allow-list (protocol.engine_flags): the allowed words and ranges are
the table's, so the builder cannot make an argv the agent refuses. A flag that is
a typed setting or set by the system is refused in extra args: vLLM takes the last
value of a repeated flag, and admission reserves memory from the typed values
(docs/operator-guide.md, "vLLM settings (containers)").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from decimal import Decimal
from typing import Any

from models_registry.llamacpp import SettingsError, parse_saved
from protocol.engine_flags import (
    CONTAINER_ANY,
    MODEL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    Flag,
    FlagRefused,
    Words,
    check_extra_args,
    engine_flags,
)

__all__ = [
    "DELIVERY",
    "DTYPES",
    "ENGINE",
    "KV_CACHE_DTYPES",
    "QUANTIZATIONS",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "SettingsError",
    "VllmSettings",
    "build_argv",
    "memory_budget_bytes",
    "saved_settings",
    "tensor_parallel",
]

ENGINE = "vllm"
DELIVERY = "container"

_TABLE = engine_flags(ENGINE)


def _flag(name: str) -> Flag:
    flag = _TABLE.lookup(name)
    if flag is None:
        raise LookupError(f"{name} is not in the {_TABLE.label} allow-list")
    return flag


def _words(name: str) -> tuple[str, ...]:
    shape = _flag(name).shape
    if not isinstance(shape, Words):
        raise TypeError(f"{name} takes no list of words in the {_TABLE.label} allow-list")
    return shape.words


DTYPES = _words("--dtype")
QUANTIZATIONS = _words("--quantization")
KV_CACHE_DTYPES = _words("--kv-cache-dtype")
TOOL_CALL_PARSERS = _words("--tool-call-parser")
REASONING_PARSERS = _words("--reasoning-parser")

# Setting -> the flag it becomes, for the ones whose value is checked by its shape.
_NUMBERS = {
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
}
_CHOICES = {
    "dtype": "--dtype",
    "quantization": "--quantization",
    "kv_cache_dtype": "--kv-cache-dtype",
    "tool_call_parser": "--tool-call-parser",
    "reasoning_parser": "--reasoning-parser",
}
_OPTIONAL = {
    "max_model_len",
    "tensor_parallel_size",
    "quantization",
    "enable_prefix_caching",
    "chat_template",
    "tool_call_parser",
    "reasoning_parser",
}


@dataclass(frozen=True, kw_only=True)
class VllmSettings:
    """The editor's vLLM section (docs/operator-guide.md, "vLLM settings (containers)")."""

    max_model_len: int | None = None  # None: the model's own (config.json)
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9  # of each placed GPU's total memory
    tensor_parallel_size: int | None = None  # None: the number of placed GPUs
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool | None = None  # None: vLLM's default
    chat_template: str | None = None  # a .jinja file name inside the model folder
    tool_call_parser: str | None = None  # also adds --enable-auto-tool-choice
    reasoning_parser: str | None = None
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> VllmSettings:
        """Parse and validate; every bad field is named in :class:`SettingsError`."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        errors: dict[str, str] = {}
        for key in sorted(set(data) - known):
            errors[key] = f"unknown setting; known settings are {', '.join(sorted(known))}"
        values = {k: v for k, v in data.items() if k in known}
        for name, value in values.items():
            if value is None and name in _OPTIONAL:
                continue
            problem = _problem(name, value)
            if problem:
                errors[name] = problem
        if errors:
            raise SettingsError(errors)
        if "gpu_memory_utilization" in values:
            values["gpu_memory_utilization"] = float(values["gpu_memory_utilization"])
        if "extra_args" in values:
            values["extra_args"] = tuple(values["extra_args"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON takes them (``extra_args`` a list)."""
        return {**asdict(self), "extra_args": list(self.extra_args)}


def _problem(name: str, value: object) -> str | None:
    """What is wrong with a non-None ``value`` of setting ``name``, or None."""
    if name in _NUMBERS:
        whole = name != "gpu_memory_utilization"
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
            return "must be a whole number" if whole else "must be a number"
        return _flag(_NUMBERS[name]).shape.problem(_arg(value))
    if name in _CHOICES:
        options = _words(_CHOICES[name])
        return None if value in options else f"must be one of {', '.join(options)}"
    if name == "enable_prefix_caching":
        return None if isinstance(value, bool) else "must be true, false or null"
    if name == "chat_template":
        if isinstance(value, str) and not _flag("--chat-template").shape.problem(
            _template_arg(value)
        ):
            return None
        return (
            "must be the name of a .jinja file inside the model folder (letters, digits, "
            "'.', '_', '-'; for example 'template.jinja'); a path or a template text is refused"
        )
    if name == "extra_args":
        if not isinstance(value, list | tuple) or not all(isinstance(a, str) for a in value):
            return "must be a list of strings"
        try:
            check_extra_args(list(value), engine=ENGINE)
        except FlagRefused as exc:
            return f"argument {exc.index}: {exc.message}"
    return None


def _arg(value: int | float) -> str:
    """A number as it goes into the argv (and as the allow-list checks it)."""
    return str(value) if isinstance(value, int) else repr(float(value))


def _template_arg(name: str) -> str:
    return f"{MODEL_PLACEHOLDER}/{name}"


def saved_settings(data: dict[str, Any] | None, *, model: str) -> VllmSettings:
    """A saved model's settings, parsed; 409 vllm_settings_invalid naming the field.

    A definition saved before a rule was tightened can hold settings that are now
    refused; starting it must say so, not fail.
    """
    return parse_saved(VllmSettings.from_dict, data, model=model, code="vllm_settings_invalid")


def tensor_parallel(settings: VllmSettings, gpus: int) -> int:
    """How many GPUs vLLM shards the model over; SettingsError if the placement differs.

    vLLM uses exactly ``--tensor-parallel-size`` of the GPUs it sees (the agent makes
    the placed ones visible), so a different number would leave placed GPUs idle or
    fail to start.
    """
    size = settings.tensor_parallel_size or max(gpus, 1)
    if gpus > 0 and size != gpus:
        raise SettingsError(
            {
                "tensor_parallel_size": (
                    f"is {size} but the placement pins {gpus} GPU(s): vLLM shards the model "
                    f"over exactly that many; leave it empty or set it to {gpus}"
                )
            }
        )
    problem = _flag("--tensor-parallel-size").shape.problem(str(size))
    if problem:
        raise SettingsError({"tensor_parallel_size": f"{size} {problem}"})
    return size


def build_argv(*, settings: VllmSettings, served_name: str, gpus: int) -> list[str]:
    """The canonical argv after ``vllm serve``, with ``{model}`` and ``{port}`` left to the agent.

    ``gpus`` is the number of GPUs the placement pins; ``--tensor-parallel-size`` is
    the setting or that number (at least 1), and a setting that differs from a
    placement's number raises :class:`SettingsError` on ``tensor_parallel_size``.
    """
    argv = [MODEL_PLACEHOLDER, "--served-model-name", served_name]
    argv += ["--host", CONTAINER_ANY, "--port", PORT_PLACEHOLDER]
    if settings.max_model_len is not None:
        argv += ["--max-model-len", _arg(settings.max_model_len)]
    argv += ["--max-num-seqs", _arg(settings.max_num_seqs)]
    argv += ["--gpu-memory-utilization", _arg(settings.gpu_memory_utilization)]
    argv += ["--tensor-parallel-size", str(tensor_parallel(settings, gpus))]
    argv += ["--dtype", settings.dtype]
    if settings.quantization is not None:
        argv += ["--quantization", settings.quantization]
    argv += ["--kv-cache-dtype", settings.kv_cache_dtype]
    if settings.enable_prefix_caching is True:
        argv += ["--enable-prefix-caching"]
    elif settings.enable_prefix_caching is False:
        argv += ["--no-enable-prefix-caching"]
    if settings.chat_template is not None:
        argv += ["--chat-template", _template_arg(settings.chat_template)]
    if settings.tool_call_parser is not None:
        # vLLM refuses a tool parser without auto tool choice, and auto tool choice
        # without a parser: the one setting makes both.
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_call_parser]
    if settings.reasoning_parser is not None:
        argv += ["--reasoning-parser", settings.reasoning_parser]
    argv += settings.extra_args
    return argv


def memory_budget_bytes(settings: VllmSettings, gpu_total_bytes: list[int]) -> list[int]:
    """What vLLM takes on each placed GPU: floor(gpu_memory_utilization x its total).

    vLLM does not grow into what it needs: at start it preallocates that fraction of
    each visible GPU's *total* memory (weights, activations, CUDA graphs and the KV
    cache all inside it) and refuses to start when less than that is free. So the
    budget is the fraction of the total whatever the model, context or batch, one
    entry per GPU in ``gpu_total_bytes`` (the placed GPUs, in order). The product is
    exact (decimal), not a float's.
    """
    fraction = Decimal(repr(settings.gpu_memory_utilization))
    return [int(fraction * total) for total in gpu_total_bytes]
