"""The engine flag allow-list itself: tables, version choice, value shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.engine_flags import (
    ENGINE_FLAG_TABLES,
    FlagRefused,
    FloatRange,
    IntRange,
    Switch,
    check_engine_argv,
    check_extra_args,
    engine_flags,
)

# Values no allowed flag may take: paths, URLs, JSON, text, and the number notations
# std::stoi/stof read beyond plain decimals.
HOSTILE_VALUES = [
    "/etc/passwd", "..", ".", "./x", "http://x", '{"a":1}', "a b", "", "nan", "inf",
    "1e3", "0x10", " 1", "1 ", "+1", "12abc", "$(id)", "*",
]  # fmt: skip


def test_each_spelling_names_one_flag() -> None:
    for table in ENGINE_FLAG_TABLES:
        names = [name for flag in table.flags for name in flag.names]
        assert len(names) == len(set(names)), table.label
        assert all(name.startswith("-") and "_" not in name for name in names)


@pytest.mark.parametrize(
    ("version", "label"),
    [("0.6.0-dev", "llama.cpp 0.6"), ("0.6.3", "llama.cpp 0.6"), (None, "llama.cpp 0.6")],
)
def test_version_picks_its_table(version: str | None, label: str) -> None:
    assert engine_flags("llamacpp", version).label == label


@pytest.mark.parametrize("version", ["fake-1", "9.1.0", "", "b4567"])
def test_a_version_no_table_covers_gets_the_newest(version: str) -> None:
    newest = max((t for t in ENGINE_FLAG_TABLES if t.engine == "llamacpp"), key=lambda t: t.last)
    assert engine_flags("llamacpp", version) is newest


def test_unknown_engine_is_an_error() -> None:
    with pytest.raises(ValueError, match="sglang"):
        engine_flags("sglang")


def test_no_value_shape_takes_a_path_url_json_or_text() -> None:
    for flag in engine_flags("llamacpp").flags:
        if isinstance(flag.shape, Switch) or flag.name == "--alias":
            continue  # --alias is the served name, a label the builder sets
        accepted = [v for v in HOSTILE_VALUES if flag.shape.problem(v) is None]
        assert accepted == [], (flag.name, accepted)


@pytest.mark.parametrize(
    ("shape", "good", "bad"),
    [
        (IntRange(-1, 10), ["-1", "0", "10"], ["-2", "11", "1.0", "01a"]),
        (FloatRange(0, 1), ["0", "0.5", "1", "1.0"], ["-0.1", "1.01", ".5", "5."]),
    ],
)
def test_range_edges(shape: IntRange | FloatRange, good: list[str], bad: list[str]) -> None:
    assert [v for v in good if shape.problem(v)] == []
    assert [v for v in bad if shape.problem(v) is None] == []


def test_extra_args_errors_carry_the_index_and_the_token() -> None:
    with pytest.raises(FlagRefused) as info:
        check_extra_args(["--temp", "0.5", "--tools", "all"])
    assert (info.value.index, info.value.flag) == (2, "--tools")
    assert "'--tools' is not an allowed llama.cpp 0.6 flag" in info.value.message


def test_a_switch_does_not_swallow_the_next_token() -> None:
    """A value-less flag followed by text: the text is refused, not taken as a value."""
    with pytest.raises(FlagRefused) as info:
        check_extra_args(["--jinja", "payload"])
    assert info.value.flag == "payload" and "neither an allowed flag" in info.value.message


def test_placeholders_only_where_the_builder_puts_them() -> None:
    base = ["-m", "{model}", "--alias", "a", "--port", "{port}"]
    assert check_engine_argv(base) == "a"
    for argv in (
        ["-m", "{port}", "--alias", "a", "--port", "{port}"],
        ["-m", "{model}", "--alias", "a", "--port", "{model}"],
        [*base, "--temp", "{port}"],
    ):
        with pytest.raises(FlagRefused):
            check_engine_argv(argv)


def test_operator_guide_lists_exactly_the_operator_flags_and_templates() -> None:
    """docs/operator-guide.md is the operator's copy of the list: it must not drift."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md").read_text()
    section = guide.split("### Extra args and chat templates", 1)[1].split("\n## ", 1)[0]
    table = engine_flags("llamacpp")
    rows = {line for line in section.splitlines() if line.startswith("| `")}
    expected = {
        "| "
        + ", ".join(f"`{n}`" for n in sorted(f.names, key=len, reverse=True))
        + f" | {f.shape.describe()} |"
        for f in table.flags
        if f.operator
    }
    assert rows == expected
    assert ", ".join(f"`{t}`" for t in table.chat_templates) in section
