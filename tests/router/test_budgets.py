"""Token budgets per day and month in the key's zone: admission under a controlled clock,
two web processes, 429 budget_exceeded through /v1, and the 80 % warning in /api/keys."""

from __future__ import annotations

import datetime as dt
import types
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from rest_framework.test import APIClient

from router import budgets, keys, usage
from router.app import RouterApp
from router.budgets import Budgets
from router.errors import V1Error
from router.keys import KeyInfo
from router.usage import UsageMeter

UTC = dt.UTC


class Clock:
    def __init__(self, moment: dt.datetime) -> None:
        self.now = moment.timestamp()

    def __call__(self) -> float:
        return self.now

    def set(self, moment: dt.datetime) -> None:
        self.now = moment.timestamp()


def _at(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


def _spend(key_id: int, prefix: str, hour: dt.datetime, tokens: int) -> None:
    """Usage as another web process's meter wrote it (hour, day and month rows)."""
    usage.add_deltas({(key_id, prefix, "m", int(hour.timestamp())): (1, tokens, 0, 0)})


async def _key(**fields: Any) -> KeyInfo:
    _, plaintext = await sync_to_async(keys.create_key)(name="team", scopes=["chat"], **fields)
    info = await sync_to_async(keys.lookup)(plaintext)
    assert info is not None
    return info


async def _refused(budget: Budgets, key: KeyInfo) -> V1Error:
    with pytest.raises(V1Error) as caught:
        await budget.admit(key)
    return caught.value


# --- periods ------------------------------------------------------------------------


def test_periods_follow_the_zone_on_utc_hours() -> None:
    day, month = budgets.periods("America/New_York", _at(2026, 12, 4, 20).timestamp())
    assert (day.start, day.end) == (
        _at(2026, 12, 4, 5).timestamp(),
        _at(2026, 12, 5, 5).timestamp(),
    )
    assert (month.start, month.end) == (
        _at(2026, 12, 1, 5).timestamp(),
        _at(2027, 1, 1, 5).timestamp(),
    )
    # Before 05:00 UTC it is still the 3rd in New York.
    early, _ = budgets.periods("America/New_York", _at(2026, 12, 4, 4, 59).timestamp())
    assert early.end == _at(2026, 12, 4, 5).timestamp()
    utc_day, utc_month = budgets.periods("UTC", _at(2026, 12, 31, 23, 30).timestamp())
    assert utc_day.end == utc_month.end == _at(2027, 1, 1).timestamp()


def test_a_half_hour_zone_starts_its_day_at_the_utc_hour_before_midnight() -> None:
    # Kolkata is UTC+5:30: its midnight is 18:30 UTC; the budget's day begins at 18:00 UTC
    # (23:30 local), because usage is kept per UTC hour.
    before, _ = budgets.periods("Asia/Kolkata", _at(2026, 12, 4, 17, 59).timestamp())
    after, _ = budgets.periods("Asia/Kolkata", _at(2026, 12, 4, 18, 10).timestamp())
    assert before.end == after.start == _at(2026, 12, 4, 18).timestamp()
    assert after.end == _at(2026, 12, 5, 18).timestamp()
    assert before.retry_after(_at(2026, 12, 4, 17, 59).timestamp()) == 60


# --- admission under a controlled clock ---------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after")
async def test_a_daily_budget_reached_mid_day_resets_at_the_zones_midnight() -> None:
    clock = Clock(_at(2026, 12, 4, 20))  # 15:00 in New York
    key = await _key(daily_token_budget=1000, budget_timezone="America/New_York")
    # 23:00 in New York on the 3rd: yesterday, not counted. 05:00 on the 4th: today.
    await sync_to_async(_spend)(key.id, key.prefix, _at(2026, 12, 4, 4), 5000)
    await sync_to_async(_spend)(key.id, key.prefix, _at(2026, 12, 4, 10), 600)
    meter = UsageMeter(clock=clock)
    budget = Budgets(meter, clock=clock)
    await budget.admit(key)  # 600 of 1000
    meter.record(key, "m", prompt_tokens=300, completion_tokens=150)  # this request's tokens

    refused = await _refused(budget, key)
    assert (refused.status, refused.code) == (429, "budget_exceeded")
    assert refused.retry_after == 9 * 3600  # to midnight in New York (05:00 UTC)
    assert "1050 of its daily budget of 1000" in refused.message
    assert "2026-12-05T05:00:00Z" in refused.message

    # Another web process: it reads the database, which holds the first process's
    # tokens once that process's meter flushed.
    other = Budgets(UsageMeter(clock=clock), clock=clock)
    await other.admit(key)  # 600: the 450 are not written yet
    await meter.flush()
    await other.refresh([key])
    assert (await _refused(other, key)).code == "budget_exceeded"
    # The first process, once it read the rows its own meter wrote, counts them once.
    await budget.refresh([key])
    assert budget.used(key, clock())[0][1] == 1050

    clock.set(_at(2026, 12, 5, 4, 59, 59))
    assert (await _refused(budget, key)).retry_after == 1
    clock.set(_at(2026, 12, 5, 5))  # midnight in New York: a new day, before any refresh
    await budget.admit(key)
    await other.admit(key)
    await budget.refresh([key])
    assert budget.used(key, clock())[0][1] == 0
    await budget.admit(key)
    await budget.stop()
    await other.stop()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after")
async def test_a_monthly_budget_counts_the_zones_month_and_resets_on_its_first() -> None:
    clock = Clock(_at(2026, 12, 15, 12))
    key = await _key(monthly_token_budget=10_000, budget_timezone="Europe/Berlin")
    # 23:00 UTC on 30 November is midnight of 1 December in Berlin: December's.
    await sync_to_async(_spend)(key.id, key.prefix, _at(2026, 11, 30, 23), 4000)
    await sync_to_async(_spend)(key.id, key.prefix, _at(2026, 11, 30, 22), 50_000)  # November
    await sync_to_async(_spend)(key.id, key.prefix, _at(2026, 12, 10, 6), 5000)
    budget = Budgets(UsageMeter(clock=clock), clock=clock)
    await budget.admit(key)  # 9000 of 10 000
    await sync_to_async(_spend)(key.id, key.prefix, _at(2026, 12, 15, 11), 1000)
    await budget.refresh([key])
    refused = await _refused(budget, key)
    assert refused.code == "budget_exceeded" and "monthly budget of 10000" in refused.message
    # 1 January 00:00 in Berlin is 31 December 23:00 UTC.
    assert refused.retry_after == int(
        (_at(2026, 12, 31, 23) - _at(2026, 12, 15, 12)).total_seconds()
    )
    clock.set(_at(2026, 12, 31, 23))
    await budget.admit(key)
    await budget.refresh([key])
    assert budget.used(key, clock())[1][1] == 0
    await budget.stop()


async def test_a_key_without_budgets_costs_nothing() -> None:
    class NoMeter:
        def tokens(self, key_id: int) -> dict[int, tuple[int, int]]:
            raise AssertionError("a key without budgets is not counted")

    budget = Budgets(NoMeter(), clock=lambda: 0.0)  # type: ignore[arg-type]
    key = KeyInfo(id=1, prefix="mbd-x", scopes=frozenset({"chat"}),
                  model_allowlist=frozenset(), expires_at=None)  # fmt: skip
    await budget.admit(key)  # no database (no django_db mark), no meter
    assert budget._task is None


# --- through /v1 --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after")
async def test_v1_answers_429_budget_exceeded_with_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row, plaintext = await sync_to_async(keys.create_key)(
        name="team", scopes=["chat"], daily_token_budget=100
    )
    hour = dt.datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    await sync_to_async(_spend)(row.pk, row.prefix, hour, 150)
    app = RouterApp()

    async def candidates(name: str) -> list[Any]:
        return [types.SimpleNamespace(served_name=name)]  # routing is not under test here

    monkeypatch.setattr(app.table, "candidates", candidates)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {plaintext}"},
        )
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "budget_exceeded"
    midnight = hour.replace(hour=0) + dt.timedelta(days=1)
    expected = (midnight - dt.datetime.now(UTC)).total_seconds()
    assert abs(int(response.headers["retry-after"]) - expected) <= 5
    await app.budgets.stop()


# --- /api/keys ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_api_keys_shows_use_and_warns_from_80_percent(operator_client: APIClient) -> None:
    created = operator_client.post(
        "/api/keys",
        {"name": "team", "dailyTokenBudget": 1000, "monthlyTokenBudget": 100_000,
         "budgetTimezone": "Europe/Berlin", "priority": 5, "queueTimeoutSeconds": 30},
        format="json",
    )  # fmt: skip
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["dailyTokenBudget"], body["monthlyTokenBudget"], body["budgetTimezone"]) == (
        1000, 100_000, "Europe/Berlin",
    )  # fmt: skip
    assert (body["priority"], body["queueTimeoutSeconds"]) == (5, 30)
    assert body["budget"]["warning"] is None and body["budget"]["day"]["used"] == 0
    info = keys.lookup(body["key"])
    assert info is not None and info.budgeted and info.budget_timezone == "Europe/Berlin"

    hour = dt.datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    _spend(body["id"], body["prefix"], hour, 850)
    listed = operator_client.get("/api/keys").json()["keys"][0]
    budget = listed["budget"]
    assert budget["day"]["limit"] == 1000 and budget["day"]["used"] == 850
    assert budget["month"]["used"] == 850
    day, _ = budgets.periods("Europe/Berlin", dt.datetime.now(UTC).timestamp())
    assert budget["day"]["resetsAt"].startswith(
        dt.datetime.fromtimestamp(day.end, UTC).strftime("%Y-%m-%dT%H:%M")
    )
    assert budget["warning"].startswith("85 % of the daily budget used")

    _spend(body["id"], body["prefix"], hour, 200)
    over = operator_client.get("/api/keys").json()["keys"][0]["budget"]["warning"]
    assert over.startswith("Over the daily budget (1050 of 1000 tokens)")
    plain = operator_client.post("/api/keys", {"name": "plain"}, format="json").json()
    assert plain["budget"] is None and plain["budgetTimezone"] == "UTC"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("priority", 1001, "priority: must be a whole number from -1000 to 1000"),
        ("priority", "1", "priority: must be a whole number"),
        ("priority", True, "priority: must be a whole number"),
        ("queueTimeoutSeconds", 0, "queueTimeoutSeconds: must be a whole number of seconds"),
        ("queueTimeoutSeconds", 86401, "queueTimeoutSeconds: must be a whole number of seconds"),
        ("dailyTokenBudget", 0, "dailyTokenBudget: must be a positive whole number"),
        ("monthlyTokenBudget", 1.5, "monthlyTokenBudget: must be a positive whole number"),
        ("monthlyTokenBudget", -3, "monthlyTokenBudget: must be a positive whole number"),
        ("budgetTimezone", "Mars/Olympus", "budgetTimezone: 'Mars/Olympus' is not an IANA"),
        ("budgetTimezone", "../etc", "budgetTimezone: '../etc' is not an IANA"),
        ("budgetTimezone", 5, "budgetTimezone: 5 is not an IANA"),
    ],
)
def test_bad_key_fields_are_refused_naming_the_field(
    operator_client: APIClient, field: str, value: object, message: str
) -> None:
    created = operator_client.post("/api/keys", {"name": "x", field: value}, format="json")
    assert created.status_code == 400
    assert created.json()["error"]["message"].startswith(message)
    row, _ = keys.create_key(name="ok", scopes=["chat"])
    patched = operator_client.patch(f"/api/keys/{row.pk}", {field: value}, format="json")
    assert patched.status_code == 400
    assert patched.json()["error"]["message"].startswith(message)
    assert keys.get_key(row.pk).budget_timezone == "UTC"


@pytest.mark.django_db
def test_patch_sets_and_clears_budgets(operator_client: APIClient) -> None:
    row, _ = keys.create_key(name="ok", scopes=["chat"], daily_token_budget=10)
    response = operator_client.patch(
        f"/api/keys/{row.pk}",
        {"dailyTokenBudget": None, "monthlyTokenBudget": 500, "budgetTimezone": "Asia/Kolkata",
         "priority": -7, "queueTimeoutSeconds": None},
        format="json",
    )  # fmt: skip
    assert response.status_code == 200, response.json()
    row.refresh_from_db()
    assert (row.daily_token_budget, row.monthly_token_budget, row.budget_timezone) == (
        None, 500, "Asia/Kolkata",
    )  # fmt: skip
    assert row.priority == -7 and response.json()["budget"]["day"] is None


@pytest.mark.django_db
def test_keys_without_permission(viewer_client: APIClient, anon_client: APIClient) -> None:
    # The budgets ride on /api/keys: the same operators-only endpoint.
    assert viewer_client.get("/api/keys").status_code == 403
    assert anon_client.get("/api/keys").status_code in (401, 403)
    assert (
        viewer_client.post(
            "/api/keys", {"name": "x", "dailyTokenBudget": 5}, format="json"
        ).status_code
        == 403
    )


# --- the console's Keys page ---------------------------------------------------------------


@pytest.mark.django_db
def test_keys_page_shows_budgets_and_the_warning(operator: Any) -> None:
    from django.test import Client

    client = Client()
    client.force_login(operator)
    row, _ = keys.create_key(name="team", scopes=["chat"], daily_token_budget=100,
                             budget_timezone="Asia/Tokyo")  # fmt: skip
    hour = dt.datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    _spend(row.pk, row.prefix, hour, 90)
    page = client.get("/keys/").content.decode()
    assert "90 / 100 tokens today" in page and "Asia/Tokyo" in page
    assert "90 % of the daily budget used" in page
    refused = client.post(
        "/keys/", {"name": "z", "scopes": ["chat"], "budget_timezone": "Nowhere/Town"}
    )
    assert refused.status_code == 400
    assert "is not an IANA time zone" in refused.content.decode()
    created = client.post(
        "/keys/", {"name": "z", "scopes": ["chat"], "monthly_token_budget": "5000",
                   "budget_timezone": "Europe/Paris", "priority": "3"},
    )  # fmt: skip
    assert created.status_code == 302
    made = keys.get_key(max(k.pk for k in keys.ApiKey.objects.all()))
    assert (made.monthly_token_budget, made.budget_timezone, made.priority) == (
        5000, "Europe/Paris", 3,
    )  # fmt: skip
