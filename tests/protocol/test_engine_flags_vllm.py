"""vLLM's flag allow-list: the positional model, the container-only delivery, the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.engine_flags import (
    ENGINE_FLAG_TABLES,
    FlagRefused,
    FloatRange,
    IntRange,
    Shape,
    Switch,
    Words,
    check_engine_argv,
    check_engine_env,
    check_extra_args,
    engine_flags,
)

# What the master's builder makes for the smallest settings (models_registry/vllm.py).
BASE = ["{model}", "--served-model-name", "org/m:awq", "--host", "0.0.0.0", "--port", "{port}"]

# Values no allowed flag may take: paths, URLs, JSON, text, odd number notations.
HOSTILE_VALUES = [
    "/etc/passwd", "..", ".", "./x", "http://x", '{"a":1}', "a b", "", "nan", "inf",
    "1e3", "0x10", " 1", "1 ", "+1", "12abc", "$(id)", "*", "{model}", "{model}/",
    "{model}/../x.jinja", "{{ messages }}", "x.jinja",
]  # fmt: skip


def refused(argv: list[str], **kwargs: str) -> FlagRefused:
    kwargs = {"engine": "vllm", "delivery": "container", **kwargs}
    with pytest.raises(FlagRefused) as info:
        check_engine_argv(argv, **kwargs)
    return info.value


@pytest.mark.parametrize("version", [None, "0.11.0", "0.6.3", "0.10.1.1", "v1", "1.0.0"])
def test_one_table_for_every_vllm_version(version: str | None) -> None:
    table = engine_flags("vllm", version)
    assert (table.engine, table.label) == ("vllm", "vLLM 0.x")


def test_llamacpp_still_gets_its_own_table() -> None:
    assert engine_flags("llamacpp").label == "llama.cpp 0.6"
    assert engine_flags("llamacpp", "9.1.0").label == "llama.cpp 0.6"


def test_each_vllm_spelling_names_one_flag() -> None:
    table = engine_flags("vllm")
    names = [name for flag in table.flags for name in flag.names]
    assert len(names) == len(set(names))
    assert all(name.startswith("-") and "_" not in name for name in names)
    assert [t for t in ENGINE_FLAG_TABLES if t.engine == "vllm"] == [table]


def test_no_vllm_value_shape_takes_a_path_url_json_or_text() -> None:
    for flag in engine_flags("vllm").flags:
        if isinstance(flag.shape, Switch) or flag.name == "--served-model-name":
            continue  # the served name is a label the builder sets
        accepted = [v for v in HOSTILE_VALUES if flag.shape.problem(v) is None]
        assert accepted == [], (flag.name, accepted)


def test_trust_remote_code_and_path_flags_are_not_listed() -> None:
    table = engine_flags("vllm")
    for name in (
        "--trust-remote-code",
        "--download-dir",
        "--lora-modules",
        "--tool-parser-plugin",
        "--chat-template-content-format",
        "--hf-overrides",
        "--config",
        "--model",
        "--api-key",
        "--ssl-keyfile",
        "--allowed-local-media-path",
    ):
        assert table.lookup(name) is None, name


def test_builder_form_is_accepted_and_returns_the_served_name() -> None:
    assert check_engine_argv(BASE, engine="vllm", delivery="container") == "org/m:awq"
    # --host may be left out: vLLM's own default listens on every address too.
    without_host = [t for t in BASE if t not in ("--host", "0.0.0.0")]
    assert check_engine_argv(without_host, engine="vllm", version="0.11.0", delivery="container")


def test_typed_flags_are_accepted_in_the_launch_argv() -> None:
    argv = [
        *BASE, "--max-model-len", "32768", "--max-num-seqs", "4096",
        "--gpu-memory-utilization", "0.98", "-tp", "4", "--dtype", "bfloat16",
        "-q", "awq_marlin", "--kv-cache-dtype", "fp8_e5m2", "--no-enable-prefix-caching",
        "--chat-template", "{model}/tool_chat_template_llama3.1_json.jinja",
        "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
        "--reasoning-parser", "openai_gptoss", "--seed", "7",
    ]  # fmt: skip
    assert check_engine_argv(argv, engine="vllm", delivery="container") == "org/m:awq"


def test_vllm_runs_only_in_a_container() -> None:
    exc = refused(BASE, delivery="process")
    assert (exc.index, exc.flag) == (0, "vllm")
    assert exc.message == "vLLM 0.x runs only as a container, not as a process"
    with pytest.raises(ValueError, match="unknown delivery"):
        check_engine_argv(BASE, engine="vllm", delivery="vm")


@pytest.mark.parametrize(
    ("argv", "index", "flag"),
    [
        (BASE[1:], 0, "--served-model-name"),
        (["/models/m", *BASE[1:]], 0, "/models/m"),
        (["{port}", *BASE[1:]], 0, "{port}"),
        (["--model", "{model}", *BASE[1:]], 0, "--model"),
    ],
)
def test_the_first_argument_must_be_the_model(argv: list[str], index: int, flag: str) -> None:
    exc = refused(argv)
    assert (exc.index, exc.flag) == (index, flag)
    assert exc.message.startswith("the first argument must be '{model}'")


def test_an_empty_argv_names_the_model() -> None:
    exc = refused([])
    assert (exc.index, exc.flag) == (0, "{model}")
    assert "must start with '{model}'" in exc.message


def test_the_model_placeholder_only_first() -> None:
    exc = refused([*BASE, "{model}"])
    assert (exc.index, exc.flag) == (7, "{model}")
    assert exc.message == "{model} may only be the first argument"
    exc = refused([*BASE, "--seed", "{model}"])
    assert (exc.index, exc.flag) == (7, "--seed")


@pytest.mark.parametrize(
    ("missing", "form"),
    [
        ("--served-model-name", "--served-model-name NAME"),
        ("--port", "--port {port}"),
    ],
)
def test_required_flags(missing: str, form: str) -> None:
    at = BASE.index(missing)
    exc = refused(BASE[:at] + BASE[at + 2 :])
    assert exc.flag == missing
    assert f"args must contain '{form}'" in exc.message


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "::", "localhost"])
def test_host_is_only_the_containers_any_address(host: str) -> None:
    exc = refused([*BASE[:4], host, *BASE[5:]])
    assert (exc.index, exc.flag) == (3, "--host")
    assert f"'--host' value {host!r} is refused" in exc.message
    assert "0.0.0.0" in exc.message


def test_port_is_only_the_placeholder() -> None:
    exc = refused([*BASE[:-1], "8001"])
    assert (exc.index, exc.flag) == (5, "--port")
    assert "'--port {port}'" in exc.message


@pytest.mark.parametrize(
    "template",
    [
        "/etc/passwd", "{model}/../x.jinja", "{model}/sub/x.jinja", "{model}/.x.jinja",
        "{model}/x.txt", "{model}/x.jinja/..", "x.jinja", "{model}",
        "{% for m in messages %}{{ m.content }}{% endfor %}", "{{ messages }}",
    ],
)  # fmt: skip
def test_chat_template_is_only_a_jinja_file_in_the_model_folder(template: str) -> None:
    exc = refused([*BASE, "--chat-template", template])
    assert (exc.index, exc.flag) == (7, "--chat-template")
    assert "'{model}/NAME.jinja'" in exc.message and "template text is refused" in exc.message


@pytest.mark.parametrize(
    ("extra", "flag", "message"),
    [
        (["--trust-remote-code"], "--trust-remote-code", "not an allowed vLLM 0.x flag"),
        (["--download-dir", "/tmp"], "--download-dir", "not an allowed vLLM 0.x flag"),
        (["--lora-modules", "x=/p"], "--lora-modules", "not an allowed vLLM 0.x flag"),
        (["--bogus-flag", "1"], "--bogus-flag", "not an allowed vLLM 0.x flag"),
        (["--max_num_seqs", "1"], "--max_num_seqs", "not an allowed vLLM 0.x flag"),
        (["--gpu-memory-util", "0.5"], "--gpu-memory-util", "not an allowed vLLM 0.x flag"),
        (["--seed=1"], "--seed=1", "write '--seed VALUE' as two arguments"),
        (["--seed", "1", "--seed", "2"], "--seed", "vLLM would take the last value"),
        (["--enforce-eager", "true"], "true", "neither an allowed flag"),
        (["--block-size", "24"], "--block-size", "must be one of 8, 16, 32, 64, 128"),
        (["--generation-config", "/models/x"], "--generation-config", "must be one of"),
        (["--tool-call-parser", "my_plugin"], "--tool-call-parser", "must be one of"),
    ],
)
def test_launch_refusals_name_the_token(extra: list[str], flag: str, message: str) -> None:
    exc = refused([*BASE, *extra])
    assert exc.flag == flag and exc.index >= len(BASE)
    assert message in exc.message


def test_equals_hint_for_vllm() -> None:
    exc = refused([*BASE, "--seed=1"])
    assert exc.message == (
        "'--seed=1': write '--seed VALUE' as two arguments "
        "(this check reads a value only as its own argument)"
    )


@pytest.mark.parametrize(
    ("arg", "setting"),
    [
        ("--gpu-memory-utilization", "gpu_memory_utilization"),
        ("--max-model-len", "max_model_len"),
        ("--max-num-seqs", "max_num_seqs"),
        ("--tensor-parallel-size", "tensor_parallel_size"),
        ("-tp", "tensor_parallel_size"),
        ("--dtype", "dtype"),
        ("-q", "quantization"),
        ("--kv-cache-dtype", "kv_cache_dtype"),
        ("--enable-prefix-caching", "enable_prefix_caching"),
        ("--chat-template", "chat_template"),
        ("--enable-auto-tool-choice", "tool_call_parser"),
        ("--tool-call-parser", "tool_call_parser"),
        ("--reasoning-parser", "reasoning_parser"),
    ],
)
def test_typed_settings_are_refused_in_extra_args_naming_the_setting(
    arg: str, setting: str
) -> None:
    with pytest.raises(FlagRefused) as info:
        check_extra_args(["--seed", "1", arg, "1"], engine="vllm")
    assert (info.value.index, info.value.flag) == (2, arg)
    assert info.value.message == (
        f"{arg!r} may not be passed as an extra arg: it is the typed setting {setting!r}; "
        "use the setting instead"
    )


@pytest.mark.parametrize("arg", ["--served-model-name", "--host", "--port"])
def test_system_flags_are_refused_in_extra_args(arg: str) -> None:
    with pytest.raises(FlagRefused, match="a typed setting or set by the system"):
        check_extra_args([arg, "x"], engine="vllm")


def test_every_operator_flag_is_allowed_in_extra_args() -> None:
    operator = [f for f in engine_flags("vllm").flags if f.operator]
    assert len(operator) >= 15
    for flag in operator:
        for name in flag.names:
            value = [] if isinstance(flag.shape, Switch) else [_top(flag.shape)]
            check_extra_args([name, *value], engine="vllm")


def _top(shape: Shape) -> str:
    """The shape's last word or the top of its range (the edge case)."""
    if isinstance(shape, Words):
        return shape.words[-1]
    assert isinstance(shape, IntRange | FloatRange), shape
    return str(shape.high)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("VLLM_ATTENTION_BACKEND", "FLASHINFER"),
        ("VLLM_USE_V1", "1"),
        ("NCCL_P2P_DISABLE", "0"),
        ("OMP_NUM_THREADS", "8"),
    ],
)
def test_env_allow_list(name: str, value: str) -> None:
    check_engine_env([(name, value)], engine="vllm")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("VLLM_API_KEY", "k", "not an allowed vLLM 0.x variable"),
        ("LD_PRELOAD", "/tmp/x.so", "not an allowed vLLM 0.x variable"),
        ("HF_HOME", "/tmp", "not an allowed vLLM 0.x variable"),
        ("VLLM_PLUGINS", "x", "not an allowed vLLM 0.x variable"),
        ("VLLM_ATTENTION_BACKEND", "/tmp/x", "must be one of"),
        ("VLLM_USE_V1", "yes", "must be one of 0, 1"),
        ("OMP_NUM_THREADS", "0", "from 1 to 1024"),
    ],
)
def test_env_refusals(name: str, value: str, message: str) -> None:
    with pytest.raises(FlagRefused) as info:
        check_engine_env([("OMP_NUM_THREADS", "4"), (name, value)], engine="vllm")
    assert (info.value.index, info.value.flag) == (1, name)
    assert message in info.value.message


def test_llamacpp_messages_are_unchanged() -> None:
    """The engine-generic check keeps llama.cpp's wording byte for byte."""
    base = ["-m", "{model}", "--alias", "a", "--port", "{port}"]
    with pytest.raises(FlagRefused) as info:
        check_engine_argv([*base, "--temp=0.2"])
    assert info.value.message == (
        "'--temp=0.2': write '--temp VALUE' as two arguments "
        "(llama-server does not read --temp=VALUE)"
    )
    with pytest.raises(FlagRefused) as info:
        check_engine_argv([*base, "{model}"])
    assert info.value.message == "{model} may only follow -m"
    with pytest.raises(FlagRefused) as info:
        check_engine_argv([*base, "--temp", "1", "--temp", "2"])
    assert info.value.message == (
        "'--temp' is given twice (also as argument 6); "
        "llama-server would take the last value, so give it once"
    )
    with pytest.raises(FlagRefused) as info:
        check_extra_args(["-c", "1"])
    assert info.value.message == (
        "'-c' may not be passed as an extra arg: it is a typed setting or set by the "
        "system; use the setting instead"
    )
    with pytest.raises(FlagRefused) as info:
        check_engine_argv(base[2:])
    assert info.value.message == "args must contain '-m {model}': the agent resolves the model file"
    assert check_engine_argv(base, delivery="container") == "a"


def test_operator_guide_lists_exactly_the_vllm_operator_flags() -> None:
    """docs/operator-guide.md is the operator's copy of the list: it must not drift."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md").read_text()
    section = guide.split("## vLLM settings (containers)", 1)[1].split("\n## ", 1)[0]
    section = section.split("### Extra args", 1)[1].split("\n### ", 1)[0]
    rows = {line for line in section.splitlines() if line.startswith("| `")}
    expected = {
        "| "
        + ", ".join(f"`{n}`" for n in sorted(f.names, key=len, reverse=True))
        + f" | {f.shape.describe()} |"
        for f in engine_flags("vllm").flags
        if f.operator
    }
    assert rows == expected
