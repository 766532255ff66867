"""The llama-server argv builder (seed 002 section 7.5)."""

from __future__ import annotations

import pytest

from models_registry.llamacpp import (
    ALWAYS_FLAGS,
    LlamaCppSettings,
    SettingsError,
    build_argv,
    execution_fingerprint,
)


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
    settings = LlamaCppSettings.from_dict({"extra_args": ["--temp", "0.2", "-sm", "row"]})
    argv = build_argv(settings=settings, served_name="m")
    assert argv[-4:] == ["--temp", "0.2", "-sm", "row"]


@pytest.mark.parametrize(
    "arg", ["--port", "--host=0.0.0.0", "-c", "--ctx-size", "-ngl", "--api-key", "--fit", "-m"]
)
def test_refused_extra_args(arg: str) -> None:
    with pytest.raises(SettingsError) as exc:
        LlamaCppSettings.from_dict({"extra_args": [arg, "1"]})
    assert "extra_args" in exc.value.errors
    assert "may not be passed" in exc.value.errors["extra_args"]


def test_path_in_extra_args_refused() -> None:
    with pytest.raises(SettingsError, match="looks like a path"):
        LlamaCppSettings.from_dict({"extra_args": ["--grammar", "/etc/passwd"]})


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
