"""Launch spec guardrails: the flag allow-list, placeholders, env, model path confinement."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from agent_support import launch_body

from agent import InvalidRequest, SpecRejected
from agent.engines._spec import (
    check_args,
    check_env,
    fingerprint,
    parse_launch_spec,
    resolve_model_path,
    substitute,
)
from tests.engine_flag_attacks import BYPASSES, ISSUE_ATTACKS

GOOD = ("-m", "{model}", "--alias", "demo", "--host", "127.0.0.1", "--port", "{port}")


def test_good_args_return_alias() -> None:
    assert check_args(GOOD) == "demo"
    assert check_args(("-m", "{model}", "-a", "x/y:z", "--port", "{port}")) == "x/y:z"


def test_builder_argv_with_every_kind_of_flag_passes() -> None:
    argv = (
        *GOOD,
        "-c", "8192", "-np", "2", "-ngl", "999", "-fa", "auto", "-ctk", "q8_0",
        "-ctv", "f16", "-b", "512", "-ub", "512", "--embedding", "--pooling", "last",
        "--chat-template", "chatml", "--device", "CUDA0,CUDA1", "--tensor-split", "3,1",
        "--reasoning", "off", "-t", "4", "--metrics", "--no-ui", "--cache-ram", "0",
        "--fit", "off", "--temp", "0.2", "--top-k", "40", "--seed", "-1", "--jinja",
        "--reasoning-format", "deepseek", "--load-mode", "mmap+mlock",
    )  # fmt: skip
    assert check_args(argv, "0.6.0-dev") == "demo"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--host", "0.0.0.0"), "--host"),
        (("--host=::",), "--host"),
        (("--port", "8080"), "--port"),
        (("--port={port}",), "--port"),
        (("--api-key", "secret"), "--api-key"),
        (("--api-key=secret",), "--api-key"),
        (("--api-key-file", "/etc/k"), "--api-key-file"),
        (("--log-file", "/tmp/x"), "--log-file"),
        (("--chat-template-file", "/x/{model}.j2"), "--chat-template-file"),
        (("{port}",), "only follow --port"),
        (("{model}",), "only follow -m"),
        (("--alias=q",), "two arguments"),
        (("--chat-template", "../../etc"), "built-in templates"),
        (("--chat-template", "{{ raise }}"), "--chat-template"),
        (("--temp", "0.2", "--temp", "0.3"), "given twice"),
        (("--temp",), "needs a value"),
        (("-m", "/etc/passwd"), "-m"),
    ],
)
def test_refused_args(extra: tuple[str, ...], needle: str) -> None:
    with pytest.raises(SpecRejected, match=r"is refused") as info:
        check_args(GOOD + extra)
    assert needle in info.value.message


@pytest.mark.parametrize(("extra", "flag"), ISSUE_ATTACKS + BYPASSES)
def test_issue_attacks_refused_naming_the_flag(extra: list[str], flag: str) -> None:
    """Issue 11: each flag the old refusal list let through, and ways around such a list."""
    with pytest.raises(SpecRejected) as info:
        check_args(GOOD + tuple(extra))
    assert info.value.status == 422 and info.value.code == "spec_rejected"
    assert f"argument {len(GOOD)} is refused" in info.value.message
    assert flag in info.value.message
    assert info.value.details == {"flag": flag}


def test_port_model_and_alias_required() -> None:
    with pytest.raises(SpecRejected, match=r"--port \{port\}"):
        check_args(("-m", "{model}", "--alias", "d"))
    with pytest.raises(SpecRejected, match=r"-m \{model\}"):
        check_args(("--alias", "d", "--port", "{port}"))
    with pytest.raises(SpecRejected, match="--alias"):
        check_args(("-m", "{model}", "--port", "{port}"))


@pytest.mark.parametrize(
    "name",
    [
        "LLAMA_API_KEY",
        "PATH",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LLAMA_ARG_HOST",
        "1BAD",
        "CUDA_VISIBLE_DEVICES",
        # Not on the allow-list: a deny-list would have let these through.
        "XDG_CONFIG_HOME",
        "GGML_SCHED_MAX_COPIES",
        "PYTHONPATH",
        "LLAMA_LOG_FILE",
    ],
)
def test_refused_env(name: str) -> None:
    with pytest.raises(SpecRejected) as exc:
        check_env(((name, "x"),))
    assert exc.value.details == {"flag": name}
    assert name in exc.value.message


@pytest.mark.parametrize(
    ("name", "value"),
    [("OMP_NUM_THREADS", "0"), ("OMP_NUM_THREADS", "2; rm -rf /"), ("GGML_CUDA_NO_PINNED", "0")],
)
def test_allowed_env_name_with_a_bad_value_is_refused(name: str, value: str) -> None:
    with pytest.raises(SpecRejected, match=name):
        check_env(((name, value),))


def test_allowed_env() -> None:
    check_env((("OMP_NUM_THREADS", "2"), ("GGML_CUDA_NO_PINNED", "1")))


def test_model_path_resolves_inside_root(models_root: Path) -> None:
    path = resolve_model_path(models_root, "demo", "demo.gguf")
    assert path == (models_root / "demo" / "demo.gguf").resolve()


@pytest.mark.parametrize(
    ("folder", "file", "needle"),
    [
        ("..", "x.gguf", "model.folder"),
        (".", "demo.gguf", "model.folder"),
        ("a/b", "x.gguf", "model.folder"),
        ("demo", "../demo/demo.gguf", "model.file"),
        ("demo", "..", "model.file"),
        ("demo", "missing.gguf", "does not exist"),
        ("nofolder", "demo.gguf", "does not exist"),
    ],
)
def test_model_path_refusals(models_root: Path, folder: str, file: str, needle: str) -> None:
    with pytest.raises(SpecRejected, match="model") as info:
        resolve_model_path(models_root, folder, file)
    assert needle in info.value.message


def test_prefix_trap_models2(tmp_path: Path) -> None:
    """/x/models2 shares a string prefix with /x/models but is not inside it."""
    root = tmp_path / "models"
    (root).mkdir()
    outside = tmp_path / "models2" / "evil"
    outside.mkdir(parents=True)
    (outside / "evil.gguf").write_bytes(b"x")
    os.symlink(outside, root / "evil")
    with pytest.raises(SpecRejected, match="outside the models root"):
        resolve_model_path(root, "evil", "evil.gguf")


def test_symlink_leaving_root_refused(models_root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    os.symlink(secret, models_root / "demo" / "link.gguf")
    with pytest.raises(SpecRejected, match="outside the models root"):
        resolve_model_path(models_root, "demo", "link.gguf")


def test_symlink_inside_root_allowed(models_root: Path) -> None:
    (models_root / "other").mkdir()
    os.symlink(models_root / "demo" / "demo.gguf", models_root / "other" / "alias.gguf")
    path = resolve_model_path(models_root, "other", "alias.gguf")
    assert path == (models_root / "demo" / "demo.gguf").resolve()


def test_models_root_itself_a_symlink(tmp_path: Path, models_root: Path) -> None:
    link = tmp_path / "models-link"
    os.symlink(models_root, link)
    assert resolve_model_path(link, "demo", "demo.gguf").is_file()


def test_substitute_and_fingerprint(tmp_path: Path) -> None:
    spec = parse_launch_spec(launch_body(env={"B": "1", "A": "2"}))
    argv = substitute(spec.args, model_path=tmp_path / "m.gguf", port=8123)
    assert argv[1] == str(tmp_path / "m.gguf") and argv[-1] == "8123"
    first = fingerprint(spec, "0.6.0")
    assert first.startswith("sha256:") and len(first) == 7 + 64
    # Env values do not count, names do; the version counts.
    assert fingerprint(parse_launch_spec(launch_body(env={"A": "x", "B": "y"})), "0.6.0") == first
    assert fingerprint(parse_launch_spec(launch_body(env={"A": "x"})), "0.6.0") != first
    assert fingerprint(spec, "0.7.0") != first


def test_fingerprint_is_documented_formula() -> None:
    import hashlib
    import json

    spec = parse_launch_spec(launch_body(env={"Z": "1"}, servedName="démo"))
    payload = {"argv": list(spec.args), "executable": "v", "env": ["Z"]}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    assert fingerprint(spec, "v") == "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_parse_names_fields() -> None:
    with pytest.raises(InvalidRequest, match="'modelId'"):
        parse_launch_spec(launch_body(modelId=True))
    with pytest.raises(InvalidRequest, match=r"'executable\.version'"):
        parse_launch_spec(launch_body(executable={"name": "llama.cpp", "version": 3}))
    spec = parse_launch_spec({**launch_body(), "futureField": 1, "env": None})
    assert spec.env == ()


def test_a_node_operator_may_allow_more_engine_variables() -> None:
    with pytest.raises(SpecRejected):
        check_env((("OMP_PROC_BIND", "close"),))
    check_env((("OMP_PROC_BIND", "close"),), node_allows=("OMP_PROC_BIND",))
    with pytest.raises(SpecRejected, match="OMP_PROC_BIND"):
        check_env((("OMP_PROC_BIND", "a\nb"),), node_allows=("OMP_PROC_BIND",))
