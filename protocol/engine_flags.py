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
agent, bypassing the master's builder, meets the same rules. The tables live beside it
(engine_flags_llamacpp.py, engine_flags_vllm.py), the shapes of a value in
flag_shapes.py; docs/operator-guide.md lists what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from protocol.engine_flags_llamacpp import LLAMACPP_06
from protocol.engine_flags_vllm import VLLM_0
from protocol.flag_shapes import (
    CONTAINER_ANY,
    DELIVERIES,
    GUIDE,
    LOOPBACK,
    MODEL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    EngineFlags,
    Flag,
    FlagRefused,
    FloatRange,
    FolderFile,
    IntRange,
    Pattern,
    Shape,
    Switch,
    Words,
    listen_host,
)

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
    "FloatRange",
    "FolderFile",
    "IntRange",
    "Pattern",
    "Shape",
    "Switch",
    "Words",
    "check_chat_template",
    "check_engine_argv",
    "check_engine_env",
    "check_extra_args",
    "engine_flags",
    "listen_host",
]

ENGINE_FLAG_TABLES: tuple[EngineFlags, ...] = (LLAMACPP_06, VLLM_0)

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
