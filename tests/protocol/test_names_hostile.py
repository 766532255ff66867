"""The one path-name rule (protocol.names) against the traversal corpus, on any platform.

The names that mean something else on Windows (drives, UNC, streams, device names,
trailing dots) are refused here, on Linux too: an agent may run on Windows, and the
master judges names for every agent alike.
"""

from __future__ import annotations

import pytest

from protocol.engine_flags import FlagRefused, check_engine_argv
from protocol.names import (
    NameRefused,
    check_file_name,
    check_folder_name,
    check_relative_path,
    is_device_name,
    path_name_problem,
)
from tests.path_corpus import HOSTILE

VLLM_ARGV = ["{model}", "--served-model-name", "m", "--port", "{port}", "--chat-template"]


@pytest.mark.parametrize(("label", "name"), HOSTILE, ids=[label for label, _ in HOSTILE])
def test_every_hostile_name_is_refused_by_each_check(label: str, name: str) -> None:
    with pytest.raises(NameRefused, match=r"^model\.folder .* must match"):
        check_folder_name(name, "model.folder")
    with pytest.raises(NameRefused, match=r"^model\.file .* must match"):
        check_file_name(name, "model.file")
    with pytest.raises(NameRefused, match="is not a plain relative file name"):
        check_relative_path(name, "hub file")
    # vLLM's chat template, {model}/NAME.jinja (a trailing dot is harmless before .jinja).
    if not name.endswith("."):
        with pytest.raises(FlagRefused):
            check_engine_argv(
                [*VLLM_ARGV, "{model}/" + name + ".jinja"], engine="vllm", delivery="container"
            )


@pytest.mark.parametrize(
    "name",
    [
        "Qwen3-4B-Q8_0.gguf",
        "model-00001-of-00002.safetensors",
        ".gitattributes",
        "a..b",
        "CONSOLE",
        "con1",
        "COM10",
        "nul_x.gguf",
        "lpt",
        "x" * 255,
    ],
)
def test_ordinary_names_pass(name: str) -> None:
    assert path_name_problem(name) is None
    assert check_file_name(name) == name
    assert check_relative_path(f"sub/{name}") == ("sub", name)


@pytest.mark.parametrize(
    ("name", "device"),
    [("CON", True), ("con.txt", True), ("Nul.tar.gz", True), ("com0", True), ("LPT9.x", True),
     ("COM10", False), ("CONSOLE", False), ("aux_x", False), ("x.con", False)],
)  # fmt: skip
def test_device_names_in_any_case_with_any_extension(name: str, device: bool) -> None:
    assert is_device_name(name) is device


def test_the_refusal_says_which_part_of_the_rule_is_broken() -> None:
    cases = {
        "a/b": "no path separator, colon, space or NUL",
        "..": "not be . or ..",
        "model.": "not end with '.'",
        "aux.gguf": "Windows device name",
        "": "1 to 200 of them",
    }
    for name, why in cases.items():
        with pytest.raises(NameRefused, match=why):
            check_folder_name(name)
    with pytest.raises(NameRefused, match="more than 16 parts"):
        check_relative_path("a/" * 16 + "b")
    long = "x" * 5000
    with pytest.raises(NameRefused) as caught:
        check_file_name(long)
    assert len(str(caught.value)) < 300, "a long name is cut short in the message"
