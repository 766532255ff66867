"""The engines' flag allow-lists: every argv token a launch may carry, defined once.

An admin key must not be a shell on the node. llama-server has flags that start
processes (``--mcp-servers-json``), enable tools (``--tools all`` holds a shell),
read or write files and directories, or open endpoints, and every release adds
more, so a list of refused flags always lags behind. This module lists what is
*allowed* instead, per engine and version range: each flag with all its
spellings and the shape of its value (none, a whole number in a range, a
decimal in a range, one of a few words). No shape accepts a path, a URL, JSON
or free-form text.

Both sides import it: the master checks an operator's ``extra_args`` and
``chat_template`` against it when a model is saved, and the agent checks the
whole argv of every launch against it again, so a spec posted straight to the
agent, bypassing the master's builder, meets the same rules. The module imports
nothing of the project (a later issue moves it into a shared protocol package
as it is); docs/operator-guide.md lists what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
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
]

MODEL_PLACEHOLDER = "{model}"
PORT_PLACEHOLDER = "{port}"
LOOPBACK = "127.0.0.1"
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


Shape = Switch | IntRange | FloatRange | Words | Pattern

SWITCH = Switch()


@dataclass(frozen=True)
class Flag:
    """One allowed flag: every spelling, its value shape, and who may set it.

    ``operator`` flags may appear in a model's ``extra_args``; the others only where
    the master's builder puts them (typed settings and the system's own flags).
    ``why`` replaces the generic refusal of a bad value where the rule is policy.
    """

    names: tuple[str, ...]
    shape: Shape
    operator: bool = False
    why: str = ""

    @property
    def name(self) -> str:
        """The long spelling, used in messages and the docs."""
        return max(self.names, key=len)


@dataclass(frozen=True)
class EngineFlags:
    """The allow-list of one engine for a range of its versions (major.minor, inclusive)."""

    engine: str
    label: str
    first: tuple[int, int]
    last: tuple[int, int]
    flags: tuple[Flag, ...]
    chat_templates: tuple[str, ...]
    # Environment variables a launch may set for the engine, each with its value
    # shape; the agent sets PATH, HOME, LANG, the key and the GPU list itself.
    env: tuple[tuple[str, Shape], ...] = ()

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
    Flag(("--host",), Words((LOOPBACK,)), why=f"engines listen on {LOOPBACK} only"),
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
)

_VERSION_RE = re.compile(r"([0-9]+)\.([0-9]+)")


def engine_flags(engine: str, version: str | None = None) -> EngineFlags:
    """The allow-list for ``engine`` at ``version`` (``0.6.0-dev`` -> the 0.6 table).

    A version no table covers, or none (the node's default, not known to the master),
    gets the newest table: an allow-list only lets through flags it names, so a
    release that adds flags adds nothing here, and one that drops a flag fails to
    start with llama-server's own message. Raises ValueError for an unknown engine.
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
            raise FlagRefused(
                at,
                token,
                f"{token!r} may not be passed as an extra arg: it is a typed setting or set "
                "by the system; use the setting instead",
            )
        if flag.name in seen:
            raise FlagRefused(
                at,
                token,
                f"{token!r} is given twice (also as argument {seen[flag.name][0]}); "
                "llama-server would take the last value, so give it once",
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
        return (
            f"{token!r}: write '{name} VALUE' as two arguments "
            f"(llama-server does not read {name}=VALUE)"
        )
    if token in (MODEL_PLACEHOLDER, PORT_PLACEHOLDER):
        return f"{token} may only follow {'-m' if token == MODEL_PLACEHOLDER else '--port'}"
    if token.startswith("-"):
        return f"{token!r} is not an allowed {table.label} flag ({GUIDE} lists the allowed flags)"
    return f"{token!r} is neither an allowed flag nor the value of the flag before it"


def check_engine_argv(
    argv: Sequence[str], *, engine: str = "llamacpp", version: str | None = None
) -> str:
    """Check a whole launch argv (the agent's check); returns the ``--alias`` value.

    Every token must be an allowed flag or the value of the flag before it in that
    flag's shape; ``{model}`` only after ``-m`` and ``{port}`` only after ``--port``;
    ``-m {model}``, ``--port {port}`` and ``--alias`` must be there. Raises
    :class:`FlagRefused` naming the first token at fault.
    """
    table = engine_flags(engine, version)
    seen = _scan(argv, table, extra=False)
    for needed, form, why in (
        ("--port", f"--port {PORT_PLACEHOLDER}", "the agent picks the port"),
        ("--model", f"-m {MODEL_PLACEHOLDER}", "the agent resolves the model file"),
        ("--alias", "--alias NAME", "the Ready check looks for it in /v1/models"),
    ):
        if needed not in seen:
            raise FlagRefused(len(argv), needed, f"args must contain '{form}': {why}")
    return seen["--alias"][1]


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
