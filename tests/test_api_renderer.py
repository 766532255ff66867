"""core.api_renderers: the same JSON as DRF's renderer, from orjson, and DRF's where
orjson refuses."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid
from typing import Any

import pytest
from rest_framework.renderers import JSONRenderer

from core.api_renderers import FastJSONRenderer

CASES: list[Any] = [
    {"a": 1, "b": [1.5, None, True, "x"], "nested": {"é": "ü", "line": "a\u2028b\u2029c"}},
    {"at": dt.datetime(2026, 12, 4, 8, 0, 0, 123456, tzinfo=dt.UTC), "day": dt.date(2026, 1, 2)},
    {"time": dt.time(8, 30), "span": dt.timedelta(seconds=90), "price": decimal.Decimal("1.50")},
    {"id": uuid.UUID(int=7), "big": 2**70, "keys": {1: "not a string key"}},
    [],
    "plain",
]


@pytest.mark.parametrize("data", CASES)
def test_the_same_json_as_drf(data: Any) -> None:
    fast = FastJSONRenderer().render(data, "application/json")
    drf = JSONRenderer().render(data, "application/json")
    assert json.loads(fast) == json.loads(drf)
    assert b"\xe2\x80\xa8" not in fast and b"\xe2\x80\xa9" not in fast  # escaped as DRF does


def test_an_indented_answer_and_none_as_drf() -> None:
    data = {"a": [1, 2]}
    indented = "application/json; indent=2"
    assert FastJSONRenderer().render(data, indented) == JSONRenderer().render(data, indented)
    assert FastJSONRenderer().render(None) == b""
