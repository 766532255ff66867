"""The engines' flag allow-lists: every argv token a launch may carry, defined once.

An admin key must not be a shell on the node. llama-server has flags that start
processes (``--mcp-servers-json``), enable tools (``--tools all`` holds a shell),
read or write files and directories, or open endpoints; vLLM's
``--trust-remote-code`` runs Python from the model folder and many of its flags
take paths, URLs or JSON. Every release adds more, so a list of refused flags
always lags behind. This module lists what is *allowed* instead, per engine and
version range: each flag with all its spellings and the shape of its value (none,
a whole number in a range, a decimal in a range, one of a few words). No shape
accepts a path, a URL, JSON or free-form text; the one file name is vLLM's chat
template, ``{model}/NAME.jinja``, a file inside the model's own read-only folder.

Both sides import it: the master checks an operator's ``extra_args`` and
``chat_template`` against it when a model is saved, and the agent checks the
whole argv of every launch against it again, so a spec posted straight to the
agent, bypassing the master's builder, meets the same rules. The module imports
only protocol.names (the rule of a file name); docs/operator-guide.md lists what is
allowed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from protocol.names import path_name_problem

__all__ = [
    "CONTAINER_ANY",
    "DELIVERIES",
    "ENGINE_FLAG_TABLES",
    "LOOPBACK",
    "MODEL_PLACEHOLDER",
    "PORT_PLACEHOLDER",
    "EngineFlags",
    "Flag",
    "FlagRefused",
    "check_chat_template",
    "check_engine_argv",
    "check_engine_env",
    "check_extra_args",
    "engine_flags",
    "listen_host",
]

MODEL_PLACEHOLDER = "{model}"
PORT_PLACEHOLDER = "{port}"
LOOPBACK = "127.0.0.1"
# Inside a container the engine listens on every address of the container's own
# network namespace; the agent publishes its port on the host's 127.0.0.1 only (or
# reaches it over the agent's container network), so nothing outside the node sees it.
CONTAINER_ANY = "0.0.0.0"
DELIVERIES = ("process", "container")


def listen_host(delivery: str) -> str:
    """The one ``--host`` value an engine of ``delivery`` may be given."""
    if delivery == "container":
        return CONTAINER_ANY
    if delivery == "process":
        return LOOPBACK
    raise ValueError(f"unknown delivery {delivery!r} (one of {', '.join(DELIVERIES)})")


GUIDE = "docs/operator-guide.md"

# A served name as the master's API accepts it (the alias is the builder's own value).
_ALIAS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")
# Plain decimal notation only: std::stoi/stof also read "1e9", "inf", "nan", hex and a
# trailing tail ("12abc" is 12), none of which a setting needs.
_INT_RE = re.compile(r"-?[0-9]{1,10}")
_FLOAT_RE = re.compile(r"-?[0-9]{1,10}(?:\.[0-9]{1,10})?")


def _plain(number: float) -> str:
    """``number`` as an operator would type it (no exponent)."""
    return str(int(number)) if float(number).is_integer() else str(number)


class FlagRefused(ValueError):
    """An argv token is not allowed: ``index`` is its position, ``flag`` the token at fault.

    ``message`` is a sentence that names the flag, for either side's error answer.
    """

    def __init__(self, index: int, flag: str, message: str) -> None:
        self.index = index
        self.flag = flag
        self.message = message
        super().__init__(message)


# -- value shapes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Switch:
    """A flag that takes no value."""

    takes_value = False

    def problem(self, value: str) -> str | None:
        return None

    def describe(self) -> str:
        return "no value"


@dataclass(frozen=True)
class IntRange:
    """A whole number from ``low`` to ``high`` (both included)."""

    low: int
    high: int
    takes_value = True

    def problem(self, value: str) -> str | None:
        if not _INT_RE.fullmatch(value) or not self.low <= int(value) <= self.high:
            return f"must be {self.describe()}"
        return None

    def describe(self) -> str:
        if self.low == self.high:
            return str(self.low)
        return f"a whole number from {self.low} to {self.high}"


@dataclass(frozen=True)
class FloatRange:
    """A decimal number (plain notation) from ``low`` to ``high`` (both included)."""

    low: float
    high: float
    takes_value = True

    def problem(self, value: str) -> str | None:
        if not _FLOAT_RE.fullmatch(value) or not self.low <= float(value) <= self.high:
            return f"must be {self.describe()}"
        return None

    def describe(self) -> str:
        return f"a decimal number from {_plain(self.low)} to {_plain(self.high)}"


@dataclass(frozen=True)
class Words:
    """One of a fixed set of words."""

    words: tuple[str, ...]
    takes_value = True

    def problem(self, value: str) -> str | None:
        return None if value in self.words else f"must be {self.describe()}"

    def describe(self) -> str:
        if len(self.words) == 1:
            return self.words[0]
        return "one of " + ", ".join(self.words)


@dataclass(frozen=True)
class Pattern:
    """A value the builder makes (a device list, a split, the alias), as a regex."""

    regex: re.Pattern[str]
    text: str
    takes_value = True

    def problem(self, value: str) -> str | None:
        return None if self.regex.fullmatch(value) else f"must be {self.text}"

    def describe(self) -> str:
        return self.text


@dataclass(frozen=True)
class FolderFile(Pattern):
    """``{model}/NAME``, a file of the model's own folder: the regex gives the form, and
    NAME must also be a safe path name (protocol.names: no Windows device name, no
    trailing dot), the one rule every name that becomes a path follows."""

    def problem(self, value: str) -> str | None:
        found = super().problem(value)
        if found is not None:
            return found
        why = path_name_problem(value.partition("/")[2])
        return None if why is None else f"must be {self.text}: NAME {why}"


Shape = Switch | IntRange | FloatRange | Words | Pattern

SWITCH = Switch()


@dataclass(frozen=True)
class Flag:
    """One allowed flag: every spelling, its value shape, and who may set it.

    ``operator`` flags may appear in a model's ``extra_args``; the others only where
    the master's builder puts them (typed settings and the system's own flags).
    ``why`` replaces the generic refusal of a bad value where the rule is policy.
    ``setting`` names the typed setting the builder makes the flag from, so a
    refusal in extra args can point to it.
    """

    names: tuple[str, ...]
    shape: Shape
    operator: bool = False
    why: str = ""
    setting: str = ""

    @property
    def name(self) -> str:
        """The long spelling, used in messages and the docs."""
        return max(self.names, key=len)


# What every launch argv must hold: (the flag's long name, the form to write, why).
Required = tuple[tuple[str, str, str], ...]

_LLAMACPP_REQUIRED: Required = (
    ("--port", f"--port {PORT_PLACEHOLDER}", "the agent picks the port"),
    ("--model", f"-m {MODEL_PLACEHOLDER}", "the agent resolves the model file"),
    ("--alias", "--alias NAME", "the Ready check looks for it in /v1/models"),
)


@dataclass(frozen=True)
class EngineFlags:
    """The allow-list of one engine for a range of its versions (major.minor, inclusive).

    The keyword-only fields describe how the engine reads its argv; their defaults
    are llama-server's, the first engine, so a table of it needs none of them.
    """

    engine: str
    label: str
    first: tuple[int, int]
    last: tuple[int, int]
    flags: tuple[Flag, ...]
    chat_templates: tuple[str, ...]
    # Environment variables a launch may set for the engine, each with its value
    # shape; the agent sets PATH, HOME, LANG, the key and the GPU list itself.
    env: tuple[tuple[str, Shape], ...] = ()
    _: KW_ONLY
    # The program as messages name it.
    program: str = "llama-server"
    # The flag whose value is the served name (check_engine_argv returns it).
    alias: str = "--alias"
    required: Required = _LLAMACPP_REQUIRED
    # The model is the first, positional argument ('{model}') instead of a flag's value.
    positional_model: bool = False
    # Whether the engine itself reads --flag=VALUE (the check never does).
    reads_equals: bool = False
    deliveries: tuple[str, ...] = DELIVERIES

    def lookup(self, token: str) -> Flag | None:
        """The flag ``token`` spells exactly, or None."""
        for flag in self.flags:
            if token in flag.names:
                return flag
        return None

    def covers(self, version: tuple[int, int]) -> bool:
        return self.first <= version <= self.last


# -- llama.cpp 0.6 -----------------------------------------------------------------------

_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

# llama-server's own list (printed under --chat-template in --help); any other value
# of --chat-template is read as a Jinja template text.
_LLAMACPP_06_TEMPLATES = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml",
    "command-r", "deepseek", "deepseek-ocr", "deepseek2", "deepseek3", "exaone-moe",
    "exaone3", "exaone4", "falcon3", "gemma", "gigachat", "glmedge", "gpt-oss",
    "granite", "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense", "hunyuan-moe",
    "hunyuan-vl", "kimi-k2", "llama2", "llama2-sys", "llama2-sys-bos",
    "llama2-sys-strip", "llama3", "llama4", "megrez", "minicpm", "mistral-v1",
    "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "monarch",
    "openchat", "orion", "pangu-embedded", "phi3", "phi4", "rwkv-world", "seed_oss",
    "smolvlm", "solar-open", "vicuna", "vicuna-orca", "yandex", "zephyr",
)  # fmt: skip

# The engine's environment: a few tuning switches, nothing that names a file, a
# library or a flag (llama-server reads LLAMA_ARG_* as flags; the loader, LD_*).
# ggml tests the two CUDA switches for being set at all, so their one value is "1".
_LLAMACPP_06_ENV: tuple[tuple[str, Shape], ...] = (
    ("OMP_NUM_THREADS", IntRange(1, 1024)),
    ("GGML_CUDA_NO_PINNED", Words(("1",))),
    ("GGML_CUDA_ENABLE_UNIFIED_MEMORY", Words(("1",))),
)

# Where the master's builder puts them (typed settings and the system's own flags).
_LLAMACPP_06_SYSTEM = (
    Flag(("-m", "--model"), Words((MODEL_PLACEHOLDER,)),
         why=f"the model is always '{MODEL_PLACEHOLDER}', the file the agent resolved"),
    Flag(("-a", "--alias"), Pattern(_ALIAS_RE, "a served name (letters, digits, . _ : / @ + -)")),
    Flag(("-c", "--ctx-size"), IntRange(16, 1_073_741_824)),
    Flag(("-np", "--parallel"), IntRange(1, 256)),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), IntRange(0, 999)),
    Flag(("-fa", "--flash-attn"), Words(("on", "off", "auto"))),
    Flag(("-ctk", "--cache-type-k"), Words(_KV_TYPES)),
    Flag(("-ctv", "--cache-type-v"), Words(_KV_TYPES)),
    Flag(("-b", "--batch-size"), IntRange(1, 1_048_576)),
    Flag(("-ub", "--ubatch-size"), IntRange(1, 1_048_576)),
    Flag(("--embedding", "--embeddings"), SWITCH),
    Flag(("--pooling",), Words(("none", "mean", "cls", "last", "rank"))),
    Flag(("--chat-template",), Words(_LLAMACPP_06_TEMPLATES),
         why="must be one of llama-server's built-in templates (a template text is refused)"),
    Flag(("-sm", "--split-mode"), Words(("none", "layer", "row", "tensor"))),
    Flag(("-dev", "--device"),
         Pattern(re.compile(r"CUDA[0-9]{1,2}(?:,CUDA[0-9]{1,2}){0,15}"), "CUDA0[,CUDA1...]")),
    Flag(("-ts", "--tensor-split"),
         Pattern(re.compile(r"[0-9]{1,9}(?:,[0-9]{1,9}){0,15}"), "whole numbers joined by ','")),
    Flag(("-rea", "--reasoning"), Words(("on", "off", "auto"))),
    Flag(("-t", "--threads"), IntRange(1, 1024)),
    # Which of the two depends on the delivery: check_engine_argv checks the pair.
    Flag(("--host",), Words((LOOPBACK, CONTAINER_ANY)),
         why=f"engines listen on {LOOPBACK} (a process) or {CONTAINER_ANY} (in a container)"),
    Flag(("--port",), Words((PORT_PLACEHOLDER,)),
         why=f"the only allowed form is '--port {PORT_PLACEHOLDER}' (the agent picks the port)"),
    Flag(("--metrics",), SWITCH),
    Flag(("--no-ui", "--no-webui"), SWITCH),
    Flag(("-cram", "--cache-ram"), IntRange(0, 0),
         why="the prompt cache in RAM stays off (admission does not count it)"),
    Flag(("-fit", "--fit"), Words(("off",)),
         why="fitting stays off (admission computed the budget from the settings)"),
)  # fmt: skip


def _op(names: tuple[str, ...], shape: Shape) -> Flag:
    return Flag(names, shape, operator=True)


# What an operator may add in extra_args: sampling defaults, rope/yarn numbers and
# performance switches. Nothing that takes a path, a URL, JSON, a directory or text,
# and nothing that enables tools, agents, MCP, props, slots, CORS or the web UI.
_LLAMACPP_06_OPERATOR = (
    _op(("--temp", "--temperature"), FloatRange(0, 10)),
    _op(("--top-k",), IntRange(0, 1_000_000)),
    _op(("--top-p",), FloatRange(0, 1)),
    _op(("--min-p",), FloatRange(0, 1)),
    _op(("--typical", "--typical-p"), FloatRange(0, 1)),
    _op(("--top-nsigma", "--top-n-sigma"), FloatRange(-1, 100)),
    _op(("--xtc-probability",), FloatRange(0, 1)),
    _op(("--xtc-threshold",), FloatRange(0, 1)),
    _op(("--repeat-penalty",), FloatRange(0, 10)),
    _op(("--repeat-last-n",), IntRange(-1, 4_194_304)),
    _op(("--presence-penalty",), FloatRange(-2, 2)),
    _op(("--frequency-penalty",), FloatRange(-2, 2)),
    _op(("--dry-multiplier",), FloatRange(0, 10)),
    _op(("--dry-base",), FloatRange(0, 10)),
    _op(("--dry-allowed-length",), IntRange(0, 65_536)),
    _op(("--dry-penalty-last-n",), IntRange(-1, 4_194_304)),
    _op(("--dynatemp-range",), FloatRange(0, 10)),
    _op(("--dynatemp-exp",), FloatRange(0, 10)),
    _op(("--mirostat",), IntRange(0, 2)),
    _op(("--mirostat-lr",), FloatRange(0, 1)),
    _op(("--mirostat-ent",), FloatRange(0, 100)),
    _op(("-s", "--seed"), IntRange(-1, 4_294_967_295)),
    _op(("-n", "--predict", "--n-predict"), IntRange(-1, 4_194_304)),
    _op(("--keep",), IntRange(-1, 4_194_304)),
    _op(("--ignore-eos",), SWITCH),
    _op(("--rope-scaling",), Words(("none", "linear", "yarn"))),
    _op(("--rope-scale",), FloatRange(0.01, 1024)),
    _op(("--rope-freq-base",), FloatRange(0, 1_000_000_000)),
    _op(("--rope-freq-scale",), FloatRange(0, 1024)),
    _op(("--yarn-orig-ctx",), IntRange(0, 4_194_304)),
    _op(("--yarn-ext-factor",), FloatRange(-1, 100)),
    _op(("--yarn-attn-factor",), FloatRange(-1, 100)),
    _op(("--yarn-beta-slow",), FloatRange(-1, 1000)),
    _op(("--yarn-beta-fast",), FloatRange(-1, 1000)),
    _op(("-lm", "--load-mode"), Words(("auto", "none", "mmap", "mlock", "mmap+mlock", "dio"))),
    _op(("--numa",), Words(("distribute", "isolate", "numactl"))),
    _op(("-tb", "--threads-batch"), IntRange(1, 1024)),
    _op(("-cb", "--cont-batching"), SWITCH),
    _op(("-nocb", "--no-cont-batching"), SWITCH),
    _op(("--cache-prompt",), SWITCH),
    _op(("--no-cache-prompt",), SWITCH),
    _op(("--cache-reuse",), IntRange(0, 1_048_576)),
    _op(("-dt", "--defrag-thold"), FloatRange(-1, 1)),
    _op(("--swa-full",), SWITCH),
    _op(("--context-shift",), SWITCH),
    _op(("--no-context-shift",), SWITCH),
    _op(("--warmup",), SWITCH),
    _op(("--no-warmup",), SWITCH),
    _op(("--jinja",), SWITCH),
    _op(("--no-jinja",), SWITCH),
    _op(("--reasoning-format",), Words(("none", "auto", "deepseek", "deepseek-legacy"))),
    _op(("--reasoning-budget",), IntRange(-1, 4_194_304)),
    _op(("--reasoning-effort",),
        Words(("default", "minimal", "low", "medium", "high", "xhigh", "max"))),
    _op(("-cmoe", "--cpu-moe"), SWITCH),
    _op(("-ncmoe", "--n-cpu-moe"), IntRange(0, 999)),
    _op(("-kvo", "--kv-offload"), SWITCH),
    _op(("-nkvo", "--no-kv-offload"), SWITCH),
    _op(("-sps", "--slot-prompt-similarity"), FloatRange(0, 1)),
    _op(("-to", "--timeout"), IntRange(1, 86_400)),
    _op(("--threads-http",), IntRange(-1, 1024)),
)  # fmt: skip

# -- vLLM 0.x ----------------------------------------------------------------------------
#
# vLLM runs only in a container, from the vllm/vllm-openai image whose entrypoint is
# `vllm serve`: the argv is what follows it, the model first (a positional argument),
# then flags. vLLM's parser also reads --flag=VALUE, "_" for "-" and any unambiguous
# prefix of a long flag; the check reads none of these, so none gets past the list.

_VLLM_SAFE_FILE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"

# The common --quantization methods for GPU checkpoints; experimental and other
# platforms' methods stay out until someone reviews them.
_VLLM_QUANTIZATION = (
    "awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "fp8", "ptpc_fp8",
    "fbgemm_fp8", "bitsandbytes", "compressed-tensors", "gguf", "marlin", "modelopt",
    "modelopt_fp4", "experts_int8", "moe_wna16", "mxfp4",
)  # fmt: skip

# vLLM's built-in parsers (a name it does not know fails at start with its own
# message); a plugin parser would be a Python file, so --tool-parser-plugin is not listed.
_VLLM_TOOL_PARSERS = (
    "deepseek_v3", "deepseek_v31", "ernie45", "glm45", "granite", "granite-20b-fc",
    "hermes", "hunyuan_a13b", "internlm", "jamba", "kimi_k2", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "minimax", "minimax_m2", "mistral",
    "olmo3", "openai", "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml",
    "seed_oss", "step3", "xlam",
)  # fmt: skip

_VLLM_REASONING_PARSERS = (
    "deepseek_r1", "deepseek_v3", "ernie45", "glm45", "granite", "hunyuan_a13b",
    "kimi_k2", "minimax_m2", "minimax_m2_append_think", "mistral", "olmo3",
    "openai_gptoss", "qwen3", "seed_oss", "step3",
)  # fmt: skip

_VLLM_ATTENTION_BACKENDS = (
    "FLASH_ATTN", "FLASHINFER", "XFORMERS", "TORCH_SDPA", "TRITON_ATTN",
    "FLEX_ATTENTION", "FLASHMLA", "TRITON_MLA", "CUTLASS_MLA",
)  # fmt: skip

# A few tuning variables; nothing that names a file, a URL, a plugin or a cache
# directory. VLLM_API_KEY is the agent's own (the engine's key), never a launch's.
_VLLM_ENV: tuple[tuple[str, Shape], ...] = (
    ("VLLM_ATTENTION_BACKEND", Words(_VLLM_ATTENTION_BACKENDS)),
    ("VLLM_USE_V1", Words(("0", "1"))),
    ("VLLM_LOGGING_LEVEL", Words(("DEBUG", "INFO", "WARNING", "ERROR"))),
    ("NCCL_P2P_DISABLE", Words(("0", "1"))),
    ("OMP_NUM_THREADS", IntRange(1, 1024)),
)

_VLLM_REQUIRED: Required = (
    ("--port", f"--port {PORT_PLACEHOLDER}", "the agent picks the port"),
    ("--served-model-name", "--served-model-name NAME",
     "the Ready check looks for it in /v1/models"),
)  # fmt: skip

# Where the master's builder puts them (models_registry/vllm.py, from typed settings).
# Admission reserves gpu_memory_utilization of each placed GPU, so the flags that
# size vLLM's memory are typed settings only.
_VLLM_SYSTEM = (
    # vLLM takes several names here; a second one is a token without a flag, refused.
    Flag(("--served-model-name",),
         Pattern(_ALIAS_RE, "a served name (letters, digits, . _ : / @ + -)")),
    Flag(("--host",), Words((CONTAINER_ANY,)),
         why=f"vLLM runs in a container and listens on {CONTAINER_ANY} there (the agent "
             "publishes the port on the node's loopback only)"),
    Flag(("--port",), Words((PORT_PLACEHOLDER,)),
         why=f"the only allowed form is '--port {PORT_PLACEHOLDER}' (the agent picks the port)"),
    Flag(("--max-model-len",), IntRange(16, 16_777_216), setting="max_model_len"),
    Flag(("--max-num-seqs",), IntRange(1, 4096), setting="max_num_seqs"),
    Flag(("--gpu-memory-utilization",), FloatRange(0.05, 0.98),
         setting="gpu_memory_utilization"),
    Flag(("-tp", "--tensor-parallel-size"), IntRange(1, 16), setting="tensor_parallel_size"),
    Flag(("--dtype",), Words(("auto", "half", "float16", "bfloat16", "float", "float32")),
         setting="dtype"),
    Flag(("-q", "--quantization"), Words(_VLLM_QUANTIZATION), setting="quantization"),
    Flag(("--kv-cache-dtype",), Words(("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
         setting="kv_cache_dtype"),
    Flag(("--enable-prefix-caching",), SWITCH, setting="enable_prefix_caching"),
    Flag(("--no-enable-prefix-caching",), SWITCH, setting="enable_prefix_caching"),
    Flag(("--enable-auto-tool-choice",), SWITCH, setting="tool_call_parser"),
    Flag(("--tool-call-parser",), Words(_VLLM_TOOL_PARSERS), setting="tool_call_parser"),
    Flag(("--reasoning-parser",), Words(_VLLM_REASONING_PARSERS),
         setting="reasoning_parser"),
    # vLLM reads any other value as a path to open, or as the template text itself.
    Flag(("--chat-template",),
         FolderFile(
             re.compile(re.escape(MODEL_PLACEHOLDER) + "/" + _VLLM_SAFE_FILE + r"\.jinja"),
             f"'{MODEL_PLACEHOLDER}/NAME.jinja', a file in the model folder"),
         why=f"the only allowed form is '{MODEL_PLACEHOLDER}/NAME.jinja', a file in the "
             "model's read-only folder (another path or a template text is refused)",
         setting="chat_template"),
)  # fmt: skip

# What an operator may add in extra_args: serving and scheduling knobs that do not
# change what admission reserves (vLLM keeps to gpu_memory_utilization whatever they
# are). Nothing that takes a path, a URL, JSON or text, and not --trust-remote-code
# (it runs Python from the model folder).
_VLLM_OPERATOR = (
    _op(("--seed",), IntRange(0, 4_294_967_295)),
    _op(("--max-num-batched-tokens",), IntRange(1, 16_777_216)),
    _op(("--enable-chunked-prefill",), SWITCH),
    _op(("--no-enable-chunked-prefill",), SWITCH),
    _op(("--max-logprobs",), IntRange(0, 100_000)),
    _op(("--disable-sliding-window",), SWITCH),
    _op(("--enforce-eager",), SWITCH),
    _op(("--disable-custom-all-reduce",), SWITCH),
    _op(("--max-seq-len-to-capture",), IntRange(1, 16_777_216)),
    _op(("--block-size",), Words(("8", "16", "32", "64", "128"))),
    _op(("--scheduling-policy",), Words(("fcfs", "priority"))),
    _op(("--generation-config",), Words(("auto", "vllm"))),
    _op(("--uvicorn-log-level",),
        Words(("critical", "error", "warning", "info", "debug", "trace"))),
    _op(("--disable-uvicorn-access-log",), SWITCH),
    _op(("--disable-log-stats",), SWITCH),
    _op(("--enable-log-requests",), SWITCH),
    _op(("--no-enable-log-requests",), SWITCH),
    _op(("--max-parallel-loading-workers",), IntRange(1, 64)),
)  # fmt: skip

ENGINE_FLAG_TABLES: tuple[EngineFlags, ...] = (
    EngineFlags(
        engine="llamacpp",
        label="llama.cpp 0.6",
        first=(0, 6),
        last=(0, 6),
        flags=_LLAMACPP_06_SYSTEM + _LLAMACPP_06_OPERATOR,
        chat_templates=_LLAMACPP_06_TEMPLATES,
        env=_LLAMACPP_06_ENV,
    ),
    EngineFlags(
        engine="vllm",
        label="vLLM 0.x",
        first=(0, 0),
        last=(0, 99),
        flags=_VLLM_SYSTEM + _VLLM_OPERATOR,
        chat_templates=(),
        env=_VLLM_ENV,
        program="vLLM",
        alias="--served-model-name",
        required=_VLLM_REQUIRED,
        positional_model=True,
        reads_equals=True,
        deliveries=("container",),
    ),
)

_VERSION_RE = re.compile(r"([0-9]+)\.([0-9]+)")


def engine_flags(engine: str, version: str | None = None) -> EngineFlags:
    """The allow-list for ``engine`` at ``version`` (``0.6.0-dev`` -> the 0.6 table).

    A version no table covers, or none (the node's default, not known to the master),
    gets the newest table: an allow-list only lets through flags it names, so a
    release that adds flags adds nothing here, and one that drops a flag fails to
    start with the engine's own message. Raises ValueError for an unknown engine.
    """
    tables = [t for t in ENGINE_FLAG_TABLES if t.engine == engine]
    if not tables:
        raise ValueError(f"no flag allow-list for engine {engine!r}")
    match = _VERSION_RE.match(version or "")
    if match:
        wanted = (int(match.group(1)), int(match.group(2)))
        for table in tables:
            if table.covers(wanted):
                return table
    return max(tables, key=lambda t: t.last)


def _scan(
    argv: Sequence[str], table: EngineFlags, *, extra: bool, offset: int = 0
) -> dict[str, tuple[int, str]]:
    """Check every token; returns each flag's long name -> (index, value or '')."""
    seen: dict[str, tuple[int, str]] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        at = index + offset
        flag = table.lookup(token)
        if flag is None:
            raise FlagRefused(at, token, _unknown(token, table))
        if extra and not flag.operator:
            what = (
                f"the typed setting {flag.setting!r}"
                if flag.setting
                else "a typed setting or set by the system"
            )
            raise FlagRefused(
                at,
                token,
                f"{token!r} may not be passed as an extra arg: it is {what}; "
                "use the setting instead",
            )
        if flag.name in seen:
            raise FlagRefused(
                at,
                token,
                f"{token!r} is given twice (also as argument {seen[flag.name][0]}); "
                f"{table.program} would take the last value, so give it once",
            )
        value = ""
        if flag.shape.takes_value:
            if index + 1 >= len(argv):
                raise FlagRefused(at, token, f"{token!r} needs a value: {flag.shape.describe()}")
            value = argv[index + 1]
            problem = flag.shape.problem(value)
            if problem:
                why = f"is refused: {flag.why}" if flag.why else problem
                raise FlagRefused(at, token, f"{token!r} value {value!r} {why}")
            index += 1
        seen[flag.name] = (at, value)
        index += 1
    return seen


def _unknown(token: str, table: EngineFlags) -> str:
    """Why ``token`` is refused, with the hint that fits it."""
    name, eq, _ = token.partition("=")
    if eq and table.lookup(name) is not None:
        # vLLM reads the joined form too; the check reads a value only as its own
        # argument, so one form is checked, not two.
        reason = (
            "this check reads a value only as its own argument"
            if table.reads_equals
            else f"{table.program} does not read {name}=VALUE"
        )
        return f"{token!r}: write '{name} VALUE' as two arguments ({reason})"
    if token == MODEL_PLACEHOLDER:
        where = "be the first argument" if table.positional_model else "follow -m"
        return f"{token} may only {where}"
    if token == PORT_PLACEHOLDER:
        return f"{token} may only follow --port"
    if token.startswith("-"):
        return f"{token!r} is not an allowed {table.label} flag ({GUIDE} lists the allowed flags)"
    return f"{token!r} is neither an allowed flag nor the value of the flag before it"


def check_engine_argv(
    argv: Sequence[str],
    *,
    engine: str = "llamacpp",
    version: str | None = None,
    delivery: str = "process",
) -> str:
    """Check a whole launch argv (the agent's check); returns the served name.

    Every token must be an allowed flag or the value of the flag before it in that
    flag's shape; ``{port}`` only after ``--port``. For llama.cpp ``{model}`` only
    after ``-m``, and ``-m {model}``, ``--port {port}`` and ``--alias NAME`` must be
    there (NAME is returned). For vLLM the first argument is ``{model}`` (its
    positional model) and ``--served-model-name NAME`` and ``--port {port}`` must be
    there; vLLM runs only in a container. ``--host``, when given, must be
    :func:`listen_host` of ``delivery``. Raises :class:`FlagRefused` naming the first
    token at fault (``flag`` is the engine's name for a delivery it does not run in).
    """
    table = engine_flags(engine, version)
    if delivery not in table.deliveries:
        listen_host(delivery)  # an unknown delivery stays a ValueError
        raise FlagRefused(
            0,
            engine,
            f"{table.label} runs only as a {' or a '.join(table.deliveries)}, not as a {delivery}",
        )
    offset = 0
    if table.positional_model:
        if not argv or argv[0] != MODEL_PLACEHOLDER:
            first = argv[0] if argv else MODEL_PLACEHOLDER
            raise FlagRefused(
                0,
                first,
                f"the first argument must be '{MODEL_PLACEHOLDER}' ({table.program}'s model, "
                f"which the agent resolves), not {first!r}"
                if argv
                else f"args must start with '{MODEL_PLACEHOLDER}': the agent resolves the model",
            )
        offset = 1
    seen = _scan(argv[offset:], table, extra=False, offset=offset)
    wanted_host = listen_host(delivery)
    if "--host" in seen and seen["--host"][1] != wanted_host:
        at, value = seen["--host"]
        raise FlagRefused(
            at,
            "--host",
            f"'--host' value {value!r} is refused for a {delivery}: it must be {wanted_host}",
        )
    for needed, form, why in table.required:
        if needed not in seen:
            raise FlagRefused(len(argv), needed, f"args must contain '{form}': {why}")
    return seen[table.alias][1]


# The value of a variable the node's operator allows (EngineEnvAllow): any text of
# reasonable length without control characters.
_OPERATOR_ENV_VALUE = Pattern(
    re.compile(r"[^\x00-\x1f\x7f]{0,4096}"), "text without control characters"
)


def check_engine_env(
    env: Sequence[tuple[str, str]],
    *,
    engine: str = "llamacpp",
    version: str | None = None,
    node_allows: Sequence[str] = (),
) -> None:
    """Check a launch's environment variables against the engine's list.

    ``node_allows`` are names the node's own operator added (the agent's
    ``EngineEnvAllow``); their values only have to be plain text. Raises
    :class:`FlagRefused` with ``flag`` set to the variable's name and ``index`` its
    position in ``env``.
    """
    table = engine_flags(engine, version)
    allowed: dict[str, Shape] = dict(table.env)
    for name in node_allows:
        allowed.setdefault(name, _OPERATOR_ENV_VALUE)
    for index, (name, value) in enumerate(env):
        shape = allowed.get(name)
        if shape is None:
            names = ", ".join(allowed) or "none"
            raise FlagRefused(
                index,
                name,
                f"env {name!r} is not an allowed {table.label} variable (allowed: {names}); "
                "set engine options in args",
            )
        problem = shape.problem(value)
        if problem:
            raise FlagRefused(index, name, f"env {name} value {value!r} {problem}")


def check_extra_args(
    args: Sequence[str], *, engine: str = "llamacpp", version: str | None = None
) -> None:
    """Check a model's ``extra_args`` (the master's check): operator flags only.

    Raises :class:`FlagRefused` naming the first token at fault (its index in ``args``).
    """
    _scan(args, engine_flags(engine, version), extra=True)


def check_chat_template(
    name: str, *, engine: str = "llamacpp", version: str | None = None
) -> str | None:
    """None when ``name`` is one of the engine's built-in templates, else why not."""
    table = engine_flags(engine, version)
    if name in table.chat_templates:
        return None
    return f"{name!r} is not a {table.label} built-in template; use one of " + ", ".join(
        table.chat_templates
    )
