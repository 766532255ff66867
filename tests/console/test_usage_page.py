"""The console's Usage page: operators only; its numbers are /api/usage's for the range."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
from typing import Any

import pytest
from django.contrib.auth.models import AbstractUser
from django.test import Client

from router import keys, usage

pytestmark = pytest.mark.django_db


def _logged_in(user: AbstractUser) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _seed() -> dt.datetime:
    """Usage of two keys (one deleted since) on two models, recent and days old.

    Returns the start of this hour, which the records are placed from.
    """
    now = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0)
    web, _ = keys.create_key(name="webapp", scopes=["chat"])
    batch, _ = keys.create_key(name="batch", scopes=["chat"])
    rows = [
        (web, "m1", now - dt.timedelta(hours=1), 5, 100, 40),
        (web, "m1", now - dt.timedelta(hours=2), 3, 60, 10),
        (web, "m2", now - dt.timedelta(hours=3), 1, 7, 2),
        (batch, "m2", now - dt.timedelta(hours=5), 10, 1000, 400),
        (batch, "m1", now - dt.timedelta(days=3), 4, 80, 8),
        (web, "m2", now - dt.timedelta(days=20), 2, 20, 4),
        (web, "m1", now - dt.timedelta(days=40), 9, 9, 9),
    ]
    # Written as the meter writes them: the hourly rows and their day and month rollups.
    usage.add_deltas(
        {
            (key.pk, key.prefix, model, int(hour.timestamp())): (requests, prompt, completion, 0)
            for key, model, hour, requests, prompt, completion in rows
        }
    )
    # A key deleted since (no row has its id) keeps its usage under its prefix.
    gone = int((now - dt.timedelta(hours=4)).timestamp())
    usage.add_deltas({(10**9, "mbd-gone", "m1", gone): (2, 30, 3, 0)})
    return now


def _api(client: Client, **params: str) -> list[dict[str, Any]]:
    answer = client.get("/api/usage", params)
    assert answer.status_code == 200, answer.content
    return answer.json()["usage"]


def _sums(rows: list[dict[str, Any]], by: str) -> dict[str, tuple[int, int, int]]:
    out: dict[str, list[int]] = {}
    for row in rows:
        counts = out.setdefault(row[by], [0, 0, 0])
        counts[0] += row["requests"]
        counts[1] += row["promptTokens"]
        counts[2] += row["completionTokens"]
    return {name: (c[0], c[1], c[2]) for name, c in out.items()}


def _tables(page: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The two tables as the page prints them: cells read back from the HTML."""
    html = page.content.decode()

    def read(table: str, attr: str) -> dict[str, tuple[int, ...]]:
        body = html.split(f'<table id="{table}">', 1)[1].split("</table>", 1)[0]
        out = {}
        for name, cells in re.findall(rf'<tr {attr}="([^"]+)">(.*?)</tr>', body, re.S):
            numbers = re.findall(r'class="(?:requests|prompt|completion)">(\d+)<', cells)
            out[name] = tuple(int(n) for n in numbers)
        return out

    return read("usage-keys", "data-key"), read("usage-models", "data-model")


def test_needs_an_operator_login(viewer: AbstractUser) -> None:
    for client in (Client(), _logged_in(viewer)):
        response = client.get("/usage/")
        assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize(
    "query",
    [{}, {"range": "1h"}, {"range": "24h"}, {"range": "7d"}, {"range": "30d"}],
)
def test_presets_equal_the_usage_api_for_the_same_range(
    operator: AbstractUser, query: dict[str, str]
) -> None:
    _seed()
    client = _logged_in(operator)
    page = client.get("/usage/", query)
    assert page.status_code == 200, page.content
    start, end = page.context["start"], page.context["end"]
    assert start.minute == 0 and end - start <= dt.timedelta(days=30, hours=1)
    api = _api(client, **{"from": start.isoformat(), "to": end.isoformat()})
    by_key, by_model = _tables(page)
    assert by_key == _sums(api, "keyPrefix")
    assert by_model == _sums(api, "model")
    assert page.context["totals"]["requests"] == sum(r["requests"] for r in api)
    # The chart holds every request and token of the range, once.
    chart = json.loads(
        page.content.decode()
        .split('<script id="usage-data" type="application/json">')[1]
        .split("</script>")[0]
    )
    assert sum(b["requests"] for b in chart["buckets"]) == sum(r["requests"] for r in api)
    assert sum(b["tokens"] for b in chart["buckets"]) == sum(r["totalTokens"] for r in api)
    # The CSV link carries the same range; the console session may download it.
    csv_answer = client.get(page.context["csv_url"])
    assert csv_answer.status_code == 200
    assert csv_answer["Content-Type"].startswith("text/csv")
    streamed = b"".join(csv_answer.streaming_content)  # type: ignore[attr-defined]  # streamed
    lines = list(csv.DictReader(io.StringIO(streamed.decode())))
    assert sum(int(line["requests"]) for line in lines) == sum(r["requests"] for r in api)


def test_the_ranges_choose_different_records(operator: AbstractUser) -> None:
    _seed()
    client = _logged_in(operator)
    requests = {
        name: client.get("/usage/", {"range": name}).context["totals"]["requests"]
        for name in ("1h", "24h", "7d", "30d")
    }
    # 1h: the hour before this one and this one; 24 h adds the others of today; 7 days
    # the one of three days ago; 30 days the one of twenty; the one of forty never.
    assert requests == {"1h": 5, "24h": 21, "7d": 25, "30d": 27}
    page = client.get("/usage/", {"range": "24h"})
    by_key, _ = _tables(page)
    assert by_key["mbd-gone"] == (2, 30, 3)
    assert b"(deleted key)" in page.content and b"webapp" in page.content


def test_dates_equal_the_api_with_the_same_dates(operator: AbstractUser) -> None:
    now = _seed()
    client = _logged_in(operator)
    start = (now - dt.timedelta(days=25)).date().isoformat()
    end = now.date().isoformat()
    page = client.get("/usage/", {"from": start, "to": end, "range": "1h"})
    assert page.status_code == 200 and page.context["preset"] == "custom"
    api = _api(client, **{"from": start, "to": end})
    by_key, by_model = _tables(page)
    assert by_key == _sums(api, "keyPrefix") and by_model == _sums(api, "model")
    assert page.context["chart"]["unit"] == "day"
    assert f'value="{start}"'.encode() in page.content  # the picker keeps the dates


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"range": "2w"}, "range: &#x27;2w&#x27; is not a range; choose one of 1h, 24h, 7d, 30d"),
        ({"from": "yesterday"}, "from: &#x27;yesterday&#x27; is not an ISO 8601 date"),
        ({"to": "2026-13-45"}, "to: &#x27;2026-13-45&#x27; is not an ISO 8601 date"),
        ({"from": "2026-06-02", "to": "2026-06-01"}, "from: must be before to"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "the page shows at most 366 days"),
    ],
)
def test_bad_ranges_get_a_clear_message(
    operator: AbstractUser, query: dict[str, str], message: str
) -> None:
    response = _logged_in(operator).get("/usage/", query)
    assert response.status_code == 400
    assert message.encode() in response.content
    assert b'id="usage-error"' in response.content and b'id="usage-keys"' not in response.content
