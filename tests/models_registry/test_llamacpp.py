"""The llama-server argv builder (docs/operator-guide.md, "llama.cpp settings")."""

from __future__ import annotations

import pytest

from models_registry.llamacpp import (
    ALWAYS_FLAGS,
    LlamaCppSettings,
    SettingsError,
    build_argv,
    execution_fingerprint,
)
from protocol.engine_flags import (
    Flag,
    FloatRange,
    IntRange,
    Switch,
    Words,
    check_engine_argv,
    engine_flags,
)
from tests.engine_flag_attacks import BYPASSES, ISSUE_ATTACKS


def test_fixed_order_and_always_flags() -> None:
    settings = LlamaCppSettings.from_dict({"context_size": 2048, "parallel": 2, "gpu_layers": 0})
    argv = build_argv(settings=settings, served_name="org/model:q4")
    assert argv[:4] == ["-m", "{model}", "--alias", "org/model:q4"]
    assert argv[argv.index("-c") + 1] == "4096"  # per slot x slots
    assert argv[argv.index("-np") + 1] == "2"
    assert argv[argv.index("-ngl") + 1] == "0"
    start = argv.index("--host")
    assert argv[start : start + len(ALWAYS_FLAGS)] == ALWAYS_FLAGS
    assert "--fit" in argv and argv[argv.index("--fit") + 1] == "off"
    assert argv[argv.index("--cache-ram") + 1] == "0"
    assert argv[argv.index("--port") + 1] == "{port}"


def test_same_settings_same_argv() -> None:
    a = build_argv(settings=LlamaCppSettings.from_dict({"parallel": 3}), served_name="m")
    b = build_argv(settings=LlamaCppSettings.from_dict({"parallel": 3}), served_name="m")
    assert a == b
    fa = execution_fingerprint(argv=a, executable_version="0.6.0", env_names=["B", "A"])
    fb = execution_fingerprint(argv=b, executable_version="0.6.0", env_names=["A", "B"])
    assert fa == fb
    assert fa != execution_fingerprint(argv=a, executable_version="0.7.0", env_names=["A", "B"])


def test_embedding_micro_batch() -> None:
    causal = LlamaCppSettings.from_dict(
        {"embedding": True, "context_size": 8192, "pooling": "last"}
    )
    argv = build_argv(settings=causal, served_name="e")
    assert argv[argv.index("-b") + 1] == argv[argv.index("-ub") + 1] == "2048"
    assert "--embedding" in argv and argv[argv.index("--pooling") + 1] == "last"
    bert = LlamaCppSettings.from_dict(
        {"embedding": True, "context_size": 512, "causal_attention": False}
    )
    argv = build_argv(settings=bert, served_name="e")
    assert argv[argv.index("-b") + 1] == argv[argv.index("-ub") + 1] == "512"


def test_extra_args_appended_last() -> None:
    settings = LlamaCppSettings.from_dict({"extra_args": ["--temp", "0.2", "--jinja"]})
    argv = build_argv(settings=settings, served_name="m")
    assert argv[-3:] == ["--temp", "0.2", "--jinja"]


@pytest.mark.parametrize(
    "arg",
    ["--port", "--host", "-c", "--ctx-size", "-ngl", "-m", "--fit", "--alias", "-sm", "-t"],
)
def test_typed_or_system_flags_refused_in_extra_args(arg: str) -> None:
    with pytest.raises(SettingsError) as exc:
        LlamaCppSettings.from_dict({"extra_args": [arg, "1"]})
    assert "may not be passed as an extra arg" in exc.value.errors["extra_args"]
    assert arg in exc.value.errors["extra_args"]


@pytest.mark.parametrize(("extra", "flag"), ISSUE_ATTACKS + BYPASSES)
def test_issue_attacks_refused_as_extra_args(extra: list[str], flag: str) -> None:
    """Issue 11: flags the old refusal list let through, and ways around such a list."""
    with pytest.raises(SettingsError) as exc:
        LlamaCppSettings.from_dict({"extra_args": ["--temp", "0.7", *extra]})
    assert set(exc.value.errors) == {"extra_args"}
    assert exc.value.errors["extra_args"].startswith("argument 2: ")
    assert repr(flag) in exc.value.errors["extra_args"]


def test_path_in_extra_args_refused() -> None:
    with pytest.raises(SettingsError, match=r"not an allowed llama\.cpp 0\.6 flag"):
        LlamaCppSettings.from_dict({"extra_args": ["--grammar-file", "/etc/passwd"]})


@pytest.mark.parametrize(
    "template", ["builtin:../../etc", "builtin:", "builtin:{{ raise }}", "builtin:CHATML"]
)
def test_chat_template_must_be_a_builtin_name(template: str) -> None:
    with pytest.raises(SettingsError) as exc:
        LlamaCppSettings.from_dict({"chat_template": template})
    assert "built-in template" in exc.value.errors["chat_template"]
    assert "chatml" in exc.value.errors["chat_template"]  # the list is in the message


def test_builtin_chat_template_accepted() -> None:
    settings = LlamaCppSettings.from_dict({"chat_template": "builtin:chatml"})
    argv = build_argv(settings=settings, served_name="m")
    assert argv[argv.index("--chat-template") + 1] == "chatml"
    # With Jinja on (llama-server's default) the name would be read as template text.
    assert argv[argv.index("--chat-template") - 1] == "--no-jinja"


def test_no_template_leaves_jinja_to_the_engine() -> None:
    argv = build_argv(settings=LlamaCppSettings.from_dict({}), served_name="m")
    assert "--no-jinja" not in argv and "--jinja" not in argv


@pytest.mark.parametrize("switch", ["--jinja", "--no-jinja"])
def test_jinja_switch_is_refused_beside_a_builtin_template(switch: str) -> None:
    with pytest.raises(SettingsError) as exc:
        LlamaCppSettings.from_dict({"chat_template": "builtin:llama3", "extra_args": [switch]})
    assert switch in exc.value.errors["extra_args"]
    assert "--no-jinja" in exc.value.errors["extra_args"]
    # Without a template the operator may still choose.
    assert LlamaCppSettings.from_dict({"extra_args": [switch]}).extra_args == [switch]


def _sample(flag: Flag) -> list[str]:
    """The flag with a value of its shape (the top of a range: the edge case)."""
    shape = flag.shape
    if isinstance(shape, Switch):
        return [flag.names[0]]
    if isinstance(shape, IntRange | FloatRange):
        return [flag.names[0], str(shape.high)]
    assert isinstance(shape, Words), flag
    return [flag.names[0], shape.words[-1]]


def test_every_operator_flag_is_accepted_and_passes_the_agent_check() -> None:
    operator = [f for f in engine_flags("llamacpp").flags if f.operator]
    assert len(operator) > 40
    extra = [token for flag in operator for token in _sample(flag)]
    settings = LlamaCppSettings.from_dict({"extra_args": extra})
    argv = build_argv(settings=settings, served_name="org/m:q4", gpus=2, tensor_split=[2**30] * 2)
    assert check_engine_argv(argv) == "org/m:q4"


@pytest.mark.parametrize(
    ("raw", "gpus"),
    [
        ({}, 0),
        ({"embedding": True, "pooling": "rank", "causal_attention": False}, 1),
        ({"batch_size": 1024, "ubatch_size": 256, "threads": 8, "reasoning": "off"}, 3),
        ({"chat_template": "builtin:llama3", "cache_type_k": "q4_0", "parallel": 256}, 0),
        ({"context_size": 4_194_304, "parallel": 256, "gpu_layers": 0}, 0),
    ],
)
def test_builder_argv_passes_the_agent_allow_list(raw: dict, gpus: int) -> None:
    """The agent checks the whole argv: everything the builder makes must be allowed."""
    settings = LlamaCppSettings.from_dict(raw)
    split = [3 * 2**30] * gpus if gpus > 1 else None
    argv = build_argv(settings=settings, served_name="m", gpus=gpus, tensor_split=split)
    assert check_engine_argv(argv, version="0.6.0-dev") == "m"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("parallel", 0, "between 1 and 256"),
        ("context_size", "big", "whole number"),
        ("flash_attention", "maybe", "one of on, off, auto"),
        ("cache_type_k", "q9", "one of"),
        ("embedding", "yes", "true or false"),
        ("chat_template", "/tmp/t.jinja", "builtin:"),
        ("nonsense", 1, "unknown setting"),
    ],
)
def test_invalid_settings_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(SettingsError) as exc:
        LlamaCppSettings.from_dict({field: value})
    assert message in exc.value.errors[field]
