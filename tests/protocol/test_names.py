"""The names both sides check: one rule each, a trailing newline never passes."""

from __future__ import annotations

import pytest

from protocol.names import NameRefused, check_folder_name, node_id_problem


@pytest.mark.parametrize("value", ["a", "gpu-1", "0box", "x" * 40])
def test_valid_node_ids(value: str) -> None:
    assert node_id_problem(value) is None


@pytest.mark.parametrize(
    "value", ["", "-a", "A", "gpu_1", "x" * 41, "gpu-1\n", "a b", None, 7, "gpu-1\x00"]
)
def test_invalid_node_ids_say_why(value: object) -> None:
    problem = node_id_problem(value)
    assert problem is not None and repr(value) in problem


@pytest.mark.parametrize("value", [".", "..", "", "a/b", "a\n", "a?file=x", "é", "x" * 201, None])
def test_folder_names_refused_name_the_field(value: object) -> None:
    with pytest.raises(NameRefused, match=r"^model\.folder "):
        check_folder_name(value, "model.folder")


def test_folder_names_accepted() -> None:
    assert check_folder_name("TinyLlama-1.1B_Q4.gguf-dir") == "TinyLlama-1.1B_Q4.gguf-dir"
