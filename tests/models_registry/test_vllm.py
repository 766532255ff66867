"""The vLLM argv builder (docs/operator-guide.md, "vLLM settings (containers)")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.errors import ServiceError
from models_registry import vllm
from models_registry.vllm import (
    SettingsError,
    VllmSettings,
    build_argv,
    memory_budget_bytes,
    saved_settings,
)
from protocol.engine_flags import (
    FloatRange,
    IntRange,
    Switch,
    Words,
    check_engine_argv,
    engine_flags,
)

HEAD = ["{model}", "--served-model-name", "m", "--host", "0.0.0.0", "--port", "{port}"]


def argv_of(raw: dict[str, Any], gpus: int = 1, name: str = "m") -> list[str]:
    return build_argv(settings=VllmSettings.from_dict(raw), served_name=name, gpus=gpus)


def agent_check(argv: list[str]) -> str:
    return check_engine_argv(argv, engine="vllm", delivery="container")


def test_defaults() -> None:
    settings = VllmSettings.from_dict({})
    assert settings == VllmSettings()
    assert build_argv(settings=settings, served_name="m", gpus=1) == [
        *HEAD,
        "--max-num-seqs", "64",
        "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "1",
        "--dtype", "auto",
        "--kv-cache-dtype", "auto",
    ]  # fmt: skip
    assert VllmSettings.from_dict(None) == settings


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"max_model_len": 32768}, ["--max-model-len", "32768"]),
        ({"max_num_seqs": 256}, ["--max-num-seqs", "256"]),
        ({"gpu_memory_utilization": 0.45}, ["--gpu-memory-utilization", "0.45"]),
        ({"gpu_memory_utilization": 0.05}, ["--gpu-memory-utilization", "0.05"]),
        ({"tensor_parallel_size": 1}, ["--tensor-parallel-size", "1"]),
        ({"dtype": "bfloat16"}, ["--dtype", "bfloat16"]),
        ({"quantization": "awq_marlin"}, ["--quantization", "awq_marlin"]),
        ({"kv_cache_dtype": "fp8"}, ["--kv-cache-dtype", "fp8"]),
        ({"enable_prefix_caching": True}, ["--enable-prefix-caching"]),
        ({"enable_prefix_caching": False}, ["--no-enable-prefix-caching"]),
        ({"chat_template": "template.jinja"}, ["--chat-template", "{model}/template.jinja"]),
        (
            {"tool_call_parser": "hermes"},
            ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        ),
        ({"reasoning_parser": "deepseek_r1"}, ["--reasoning-parser", "deepseek_r1"]),
        ({"extra_args": ["--seed", "7", "--enforce-eager"]}, ["--seed", "7", "--enforce-eager"]),
    ],
)
def test_each_setting_becomes_its_flag(raw: dict[str, Any], fragment: list[str]) -> None:
    argv = argv_of(raw)
    assert argv[: len(HEAD)] == HEAD
    start = argv.index(fragment[0])
    assert argv[start : start + len(fragment)] == fragment
    assert agent_check(argv) == "m"


@pytest.mark.parametrize(
    ("name", "absent"),
    [
        ("max_model_len", "--max-model-len"),
        ("quantization", "--quantization"),
        ("enable_prefix_caching", "--enable-prefix-caching"),
        ("chat_template", "--chat-template"),
        ("tool_call_parser", "--enable-auto-tool-choice"),
        ("reasoning_parser", "--reasoning-parser"),
    ],
)
def test_unset_optional_settings_leave_vllms_default(name: str, absent: str) -> None:
    argv = argv_of({name: None})
    assert absent not in argv and "--no-enable-prefix-caching" not in argv


def test_extra_args_come_last() -> None:
    argv = argv_of({"reasoning_parser": "qwen3", "extra_args": ["--seed", "1"]})
    assert argv[-4:] == ["--reasoning-parser", "qwen3", "--seed", "1"]


def test_same_settings_same_argv() -> None:
    raw = {"max_model_len": 4096, "tool_call_parser": "mistral", "extra_args": ["--seed", "3"]}
    assert argv_of(raw) == argv_of(dict(reversed(raw.items())))


@pytest.mark.parametrize(
    ("raw", "gpus"),
    [
        ({}, 0),
        ({}, 8),
        ({"max_model_len": 16_777_216, "max_num_seqs": 4096, "gpu_memory_utilization": 0.98}, 1),
        ({"max_model_len": 16, "max_num_seqs": 1, "gpu_memory_utilization": 0.05}, 1),
        ({"tensor_parallel_size": 4, "dtype": "half", "quantization": "gptq_marlin"}, 4),
        ({"tensor_parallel_size": 16}, 16),
        ({"kv_cache_dtype": "fp8_e4m3", "enable_prefix_caching": False, "dtype": "float"}, 2),
        (
            {
                "chat_template": "tool_chat_template_llama3.1_json.jinja",
                "tool_call_parser": "llama3_json",
                "reasoning_parser": "openai_gptoss",
                "enable_prefix_caching": True,
                "quantization": "mxfp4",
                "extra_args": ["--max-num-batched-tokens", "8192", "--no-enable-chunked-prefill"],
            },
            2,
        ),
    ],
)
def test_builder_argv_passes_the_agent_allow_list(raw: dict[str, Any], gpus: int) -> None:
    """The agent checks the whole argv: everything the builder makes must be allowed."""
    argv = argv_of(raw, gpus=gpus, name="org/model:awq")
    assert agent_check(argv) == "org/model:awq"


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("dtype", "--dtype"),
        ("quantization", "--quantization"),
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("tool_call_parser", "--tool-call-parser"),
        ("reasoning_parser", "--reasoning-parser"),
    ],
)
def test_every_allowed_word_builds_an_allowed_argv(name: str, flag: str) -> None:
    shape = engine_flags("vllm").lookup(flag).shape  # type: ignore[union-attr]
    assert isinstance(shape, Words)
    for word in shape.words:
        assert agent_check(argv_of({name: word})) == "m", word


def test_word_lists_are_the_protocol_tables() -> None:
    table = engine_flags("vllm")
    for constant, flag in (
        (vllm.DTYPES, "--dtype"),
        (vllm.QUANTIZATIONS, "--quantization"),
        (vllm.KV_CACHE_DTYPES, "--kv-cache-dtype"),
        (vllm.TOOL_CALL_PARSERS, "--tool-call-parser"),
        (vllm.REASONING_PARSERS, "--reasoning-parser"),
    ):
        assert constant is table.lookup(flag).shape.words  # type: ignore[union-attr]


def _sample(shape: object, name: str) -> list[str]:
    if isinstance(shape, Switch):
        return [name]
    if isinstance(shape, IntRange | FloatRange):
        return [name, str(shape.high)]
    assert isinstance(shape, Words), shape
    return [name, shape.words[-1]]


def test_every_operator_flag_is_accepted_and_passes_the_agent_check() -> None:
    operator = [f for f in engine_flags("vllm").flags if f.operator]
    extra = [token for flag in operator for token in _sample(flag.shape, flag.names[0])]
    settings = VllmSettings.from_dict({"extra_args": extra})
    assert settings.extra_args == tuple(extra)
    argv = build_argv(settings=settings, served_name="m", gpus=2)
    assert agent_check(argv) == "m"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("nonsense", 1, "unknown setting; known settings are chat_template, dtype"),
        ("maxModelLen", 4096, "unknown setting"),
        ("max_model_len", 8, "must be a whole number from 16 to 16777216"),
        ("max_model_len", 16_777_217, "from 16 to 16777216"),
        ("max_model_len", "4096", "must be a whole number"),
        ("max_model_len", 4096.0, "must be a whole number"),
        ("max_num_seqs", 0, "must be a whole number from 1 to 4096"),
        ("max_num_seqs", 4097, "from 1 to 4096"),
        ("max_num_seqs", True, "must be a whole number"),
        ("max_num_seqs", None, "must be a whole number"),
        ("gpu_memory_utilization", 0.99, "must be a decimal number from 0.05 to 0.98"),
        ("gpu_memory_utilization", 0.01, "from 0.05 to 0.98"),
        ("gpu_memory_utilization", 1, "from 0.05 to 0.98"),
        ("gpu_memory_utilization", "0.9", "must be a number"),
        ("gpu_memory_utilization", float("nan"), "from 0.05 to 0.98"),
        ("tensor_parallel_size", 0, "must be a whole number from 1 to 16"),
        ("tensor_parallel_size", 17, "from 1 to 16"),
        ("dtype", "fp16", "must be one of auto, half, float16, bfloat16, float"),
        ("quantization", "aqlm_custom", "must be one of awq"),
        ("kv_cache_dtype", "int8", "must be one of auto, fp8, fp8_e4m3, fp8_e5m2"),
        ("enable_prefix_caching", "yes", "must be true, false or null"),
        ("tool_call_parser", "/tmp/plugin.py", "must be one of"),
        ("reasoning_parser", "gpt_oss", "must be one of"),
        ("extra_args", "--seed 1", "must be a list of strings"),
        ("extra_args", ["--seed", 1], "must be a list of strings"),
    ],
)
def test_invalid_settings_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(SettingsError) as exc:
        VllmSettings.from_dict({field: value})
    assert set(exc.value.errors) == {field}
    assert message in exc.value.errors[field]


@pytest.mark.parametrize(
    "template",
    [
        "/etc/passwd",
        "../x.jinja",
        "{model}/../x.jinja",
        "{model}/x.jinja",
        "sub/x.jinja",
        ".hidden.jinja",
        "template.txt",
        "template",
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
        "builtin:chatml",
        "",
        7,
    ],
)
def test_chat_template_is_only_a_file_name_in_the_model_folder(template: object) -> None:
    with pytest.raises(SettingsError) as exc:
        VllmSettings.from_dict({"chat_template": template})
    assert "a .jinja file inside the model folder" in exc.value.errors["chat_template"]
    assert "a path or a template text is refused" in exc.value.errors["chat_template"]


@pytest.mark.parametrize(
    ("extra", "token", "message"),
    [
        (["--trust-remote-code"], "--trust-remote-code", "is not an allowed vLLM 0.x flag"),
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization", "'gpu_memory_utilization'"),
        (["--max-model-len", "100000"], "--max-model-len", "the typed setting 'max_model_len'"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size", "'tensor_parallel_size'"),
        (["-tp", "2"], "-tp", "the typed setting 'tensor_parallel_size'"),
        (["--chat-template", "{model}/t.jinja"], "--chat-template", "'chat_template'"),
        (["--download-dir", "/tmp"], "--download-dir", "is not an allowed vLLM 0.x flag"),
        (["--lora-modules", "x=/p"], "--lora-modules", "is not an allowed vLLM 0.x flag"),
        (["--seed=1"], "--seed=1", "write '--seed VALUE' as two arguments"),
        (["--definitely-not-a-flag"], "--definitely-not-a-flag", "not an allowed vLLM 0.x flag"),
        (["--host", "0.0.0.0"], "--host", "a typed setting or set by the system"),
        (["--port", "8001"], "--port", "a typed setting or set by the system"),
        (["{model}"], "{model}", "{model} may only be the first argument"),
        (["--seed", "-1"], "--seed", "from 0 to 4294967295"),
        (["1"], "1", "neither an allowed flag nor the value"),
    ],
)  # fmt: skip
def test_extra_args_refusals_name_the_token(extra: list[str], token: str, message: str) -> None:
    with pytest.raises(SettingsError) as exc:
        VllmSettings.from_dict({"extra_args": ["--enforce-eager", *extra]})
    assert set(exc.value.errors) == {"extra_args"}
    problem = exc.value.errors["extra_args"]
    assert problem.startswith("argument 1: ")
    assert repr(token) in problem or problem.startswith(f"argument 1: {token} ")
    assert message in problem


def test_extra_args_error_gives_the_index() -> None:
    with pytest.raises(SettingsError) as exc:
        VllmSettings.from_dict({"extra_args": ["--enforce-eager", "--trust-remote-code"]})
    assert exc.value.errors["extra_args"].startswith("argument 1: '--trust-remote-code'")


def test_every_bad_field_is_collected() -> None:
    with pytest.raises(SettingsError) as exc:
        VllmSettings.from_dict(
            {
                "max_num_seqs": 0,
                "gpu_memory_utilization": 2.0,
                "chat_template": "/etc/passwd",
                "extra_args": ["--trust-remote-code"],
                "bogus": True,
            }
        )
    assert set(exc.value.errors) == {
        "max_num_seqs",
        "gpu_memory_utilization",
        "chat_template",
        "extra_args",
        "bogus",
    }


@pytest.mark.parametrize(("size", "gpus"), [(2, 1), (1, 2), (4, 8)])
def test_tensor_parallel_size_must_match_the_placed_gpus(size: int, gpus: int) -> None:
    settings = VllmSettings.from_dict({"tensor_parallel_size": size})
    with pytest.raises(SettingsError) as exc:
        build_argv(settings=settings, served_name="m", gpus=gpus)
    problem = exc.value.errors["tensor_parallel_size"]
    assert f"is {size} but the placement pins {gpus} GPU(s)" in problem


@pytest.mark.parametrize(
    ("size", "gpus", "expected"),
    [(None, 0, "1"), (None, 1, "1"), (None, 4, "4"), (2, 0, "2"), (2, 2, "2")],
)
def test_tensor_parallel_size_is_the_setting_or_the_placed_gpus(
    size: int | None, gpus: int, expected: str
) -> None:
    argv = argv_of({"tensor_parallel_size": size}, gpus=gpus)
    assert argv[argv.index("--tensor-parallel-size") + 1] == expected


def test_more_gpus_than_the_allow_list_takes_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="tensor_parallel_size"):
        argv_of({}, gpus=17)


def test_memory_budget_is_the_fraction_of_each_gpu() -> None:
    gib = 2**30
    settings = VllmSettings.from_dict({"gpu_memory_utilization": 0.9})
    assert memory_budget_bytes(settings, [80 * gib, 141 * 10**9]) == [
        77_309_411_328,  # floor(0.9 x 85_899_345_920)
        126_900_000_000,
    ]
    third = VllmSettings.from_dict({"gpu_memory_utilization": 0.33})
    assert memory_budget_bytes(third, [1001]) == [330]  # floor(330.33)
    assert memory_budget_bytes(third, []) == []
    # Independent of what the model would need: only the fraction counts.
    long = VllmSettings.from_dict({"gpu_memory_utilization": 0.33, "max_model_len": 131072})
    assert memory_budget_bytes(long, [1001]) == [330]


def test_to_dict_round_trips_through_json() -> None:
    raw = {
        "max_model_len": 8192,
        "gpu_memory_utilization": 0.5,
        "chat_template": "chat.jinja",
        "tool_call_parser": "hermes",
        "enable_prefix_caching": False,
        "extra_args": ["--seed", "1"],
    }
    settings = VllmSettings.from_dict(raw)
    wire = json.loads(json.dumps(settings.to_dict()))
    assert wire["extra_args"] == ["--seed", "1"]
    assert {k: wire[k] for k in raw} == raw
    assert VllmSettings.from_dict(wire) == settings


def test_saved_settings_refused_now_is_a_409_naming_the_field() -> None:
    assert saved_settings({"max_num_seqs": 8}, model="m").max_num_seqs == 8
    with pytest.raises(ServiceError) as exc:
        saved_settings({"extra_args": ["--trust-remote-code"]}, model="org/m")
    assert (exc.value.status, exc.value.code) == (409, "vllm_settings_invalid")
    assert "Model 'org/m': its saved settings.extra_args are refused now" in exc.value.message
    assert "--trust-remote-code" in exc.value.details["fields"]["settings.extra_args"]
