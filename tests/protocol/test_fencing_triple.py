"""The fencing triple's one rule, as the agent and the master both apply it."""

from __future__ import annotations

import pytest

from protocol.fencing import FencingHeaderError, Triple, parse_time, parse_triple, verdict

FLOOR = Triple("m1", 5, "b1")


@pytest.mark.parametrize(
    ("incoming", "expected"),
    [
        (Triple("m1", 6, "b2"), "higher"),
        (Triple("other", 6, "x"), "higher"),
        (Triple("m1", 5, "b1"), "same"),
        (Triple("m1", 5, "b2"), "competing"),
        (Triple("m2", 5, "b1"), "competing"),
        (Triple("m1", 4, "b1"), "stale"),
    ],
)
def test_verdict_against_a_floor(incoming: Triple, expected: str) -> None:
    assert verdict(FLOOR, incoming) == expected


def test_no_floor_accepts_anything() -> None:
    assert verdict(None, Triple("m", 0, "b")) == "higher"


def test_header_round_trip() -> None:
    assert parse_triple(FLOOR.header()) == FLOOR
    assert Triple.from_json(FLOOR.to_json()) == FLOOR


@pytest.mark.parametrize("value", [None, "", "m1/5", "m1/x/b1", "m1/5/b1\n/", "m 1/5/b1"])
def test_malformed_triples_name_the_header(value: str | None) -> None:
    with pytest.raises(FencingHeaderError, match="MirbadLLM-Master"):
        parse_triple(value)


@pytest.mark.parametrize("value", [None, "yesterday", "2026-12-01T10:00:00"])
def test_malformed_times_name_the_header(value: str | None) -> None:
    with pytest.raises(FencingHeaderError, match="MirbadLLM-Request-Time"):
        parse_time(value)


def test_master_and_agent_agree_on_outranking() -> None:
    """nodes.fencing.outranks is the agent's refusal seen from the master."""
    from nodes.fencing import outranks

    assert outranks(FLOOR.to_json(), Triple("m1", 4, "b1"))  # the agent would say stale
    assert outranks(FLOOR.to_json(), Triple("m2", 5, "b9"))  # competing
    assert not outranks(FLOOR.to_json(), Triple("m1", 5, "b1"))
    assert not outranks(FLOOR.to_json(), Triple("m1", 6, "b1"))
    assert not outranks({"epoch": "x"}, Triple("m1", 6, "b1"))
