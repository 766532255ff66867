"""The shapes of an engine flag's value and the table type (protocol/engine_flags.py).

Split from the allow-lists so that each engine's table (engine_flags_llamacpp.py,
engine_flags_vllm.py) and the checks import one definition of what a flag is.
"""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass

from protocol.names import path_name_problem

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
ALIAS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")
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


def op(names: tuple[str, ...], shape: Shape) -> Flag:
    """A flag an operator may add in ``extra_args``."""
    return Flag(names, shape, operator=True)
