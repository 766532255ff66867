"""/api/keys limits and PATCH, /api/usage and /api/usage.csv (permissions: tests/test_api.py)."""

from __future__ import annotations

import csv
import datetime
import io

import pytest
from rest_framework.test import APIClient

from router import keys, usage
from router.models import ApiKey

pytestmark = pytest.mark.django_db

H = datetime.datetime(2026, 11, 30, 22, tzinfo=datetime.UTC)


def test_create_with_limits_and_list(operator_client: APIClient) -> None:
    created = operator_client.post(
        "/api/keys",
        {"name": "app", "scopes": ["chat"], "rpmLimit": 60, "tpmLimit": 10000,
         "concurrencyLimit": 4, "models": ["m1"]},
        format="json",
    )  # fmt: skip
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["rpmLimit"], body["tpmLimit"], body["concurrencyLimit"]) == (60, 10000, 4)
    listed = operator_client.get("/api/keys").json()["keys"][0]
    assert listed["rpmLimit"] == 60 and listed["lastUsedAt"] is None and "key" not in listed
    info = keys.lookup(body["key"])
    assert info is not None and info.limited
    assert (info.rpm_limit, info.tpm_limit, info.concurrency_limit) == (60, 10000, 4)
    plain = operator_client.post("/api/keys", {"name": "plain"}, format="json").json()
    assert plain["rpmLimit"] is None and not keys.lookup(plain["key"]).limited


@pytest.mark.parametrize("value", [0, -1, 1.5, "10", True])
def test_limits_must_be_positive_integers(operator_client: APIClient, value: object) -> None:
    response = operator_client.post("/api/keys", {"name": "x", "tpmLimit": value}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("tpmLimit: must be a positive")
    assert not ApiKey.objects.exists()


def test_create_key_service_names_the_field() -> None:
    with pytest.raises(keys.KeyError_) as info:
        keys.create_key(name="x", scopes=["chat"], concurrency_limit=0)
    assert info.value.field == "concurrency_limit"
    assert str(info.value).startswith("concurrency_limit: ")


def test_patch_changes_limits_name_allowlist_expiry(operator_client: APIClient) -> None:
    row, _ = keys.create_key(name="app", scopes=["chat"], rpm_limit=10)
    response = operator_client.patch(
        f"/api/keys/{row.pk}",
        {"name": "renamed", "tpmLimit": 500, "rpmLimit": None, "models": ["b", "a"],
         "expiresAt": "2030-01-01T00:00:00Z"},
        format="json",
    )  # fmt: skip
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["name"] == "renamed" and body["models"] == ["a", "b"]
    assert (body["rpmLimit"], body["tpmLimit"], body["concurrencyLimit"]) == (None, 500, None)
    assert body["expiresAt"].startswith("2030-01-01")
    row.refresh_from_db()
    assert row.tpm_limit == 500 and row.rpm_limit is None

    scopes = operator_client.patch(f"/api/keys/{row.pk}", {"scopes": ["admin"]}, format="json")
    assert scopes.status_code == 400
    assert scopes.json()["error"]["message"].startswith("scopes: cannot change")
    unknown = operator_client.patch(f"/api/keys/{row.pk}", {"colour": 1}, format="json")
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"]
    bad = operator_client.patch(f"/api/keys/{row.pk}", {"rpmLimit": 0}, format="json")
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("rpmLimit:")
    missing = operator_client.patch("/api/keys/99999", {"name": "x"}, format="json")
    assert missing.status_code == 404
    assert operator_client.delete("/api/keys/99999").status_code == 404


def _usage() -> tuple[ApiKey, ApiKey]:
    a, _ = keys.create_key(name="alpha", scopes=["chat"])
    b, _ = keys.create_key(name="=beta", scopes=["chat"])  # a formula, for the CSV
    rows = [
        (a, "m1", H, 3, 30, 10),
        (a, "m1", H + datetime.timedelta(hours=1), 2, 20, 5),
        (a, "m2", H + datetime.timedelta(hours=1), 1, 7, 1),
        (b, "m1", H + datetime.timedelta(hours=2), 4, 100, 50),
        (a, "m1", H - datetime.timedelta(days=3), 9, 900, 900),  # outside the range
    ]
    # Written as the meter writes them: the hourly rows and their day and month rollups.
    usage.add_deltas(
        {
            (key.pk, key.prefix, model, int(hour.timestamp())): (requests, prompt, completion, 0)
            for key, model, hour, requests, prompt, completion in rows
        }
    )
    return a, b


def test_usage_summary_per_key_and_model(operator_client: APIClient) -> None:
    a, b = _usage()
    response = operator_client.get(
        "/api/usage", {"from": "2026-11-30T22:30:00Z", "to": "2026-12-01"}
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["from"] == "2026-11-30T22:00:00+00:00"  # rounded down to its hour
    assert body["to"] == "2026-12-02T00:00:00+00:00"  # a day as the end includes that day
    got = {(u["keyName"], u["model"]): u for u in body["usage"]}
    assert set(got) == {("alpha", "m1"), ("alpha", "m2"), ("=beta", "m1")}
    assert got[("alpha", "m1")] == {
        "keyId": a.pk, "keyPrefix": a.prefix, "keyName": "alpha", "model": "m1",
        "requests": 5, "promptTokens": 50, "completionTokens": 15, "totalTokens": 65,
        "errors": 0,
    }  # fmt: skip
    assert body["usage"][0]["keyId"] == b.pk  # the most tokens first
    assert body["totals"] == {
        "requests": 10, "promptTokens": 157, "completionTokens": 66, "totalTokens": 223,
        "errors": 0,
    }  # fmt: skip
    only_a = operator_client.get(
        "/api/usage", {"from": "2026-11-30", "to": "2026-12-01", "key": a.pk, "model": "m2"}
    ).json()
    assert [(u["model"], u["requests"]) for u in only_a["usage"]] == [("m2", 1)]


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ({"from": "yesterday"}, "from:"),
        ({"to": "2026-13-45"}, "to:"),
        ({"key": "abc"}, "key:"),
        ({"from": "2026-12-02", "to": "2026-12-01T00:00:00Z"}, "from: must be before to"),
    ],
)
def test_usage_query_errors_name_the_parameter(
    operator_client: APIClient, query: dict, named: str
) -> None:
    for path in ("/api/usage", "/api/usage.csv"):
        response = operator_client.get(path, query)
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith(named)


def test_usage_csv(operator_client: APIClient) -> None:
    a, b = _usage()
    response = operator_client.get(
        "/api/usage.csv",
        {"from": "2026-11-30", "to": "2026-12-01"},
        HTTP_ACCEPT="text/csv",
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"] == (
        'attachment; filename="usage-20261130T0000-20261202T0000.csv"'
    )
    rows = list(csv.reader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert rows == [
        list(usage.CSV_HEADER),
        ["2026-11-30T22:00:00Z", a.prefix, "alpha", "m1", "3", "30", "10", "0"],
        ["2026-11-30T23:00:00Z", a.prefix, "alpha", "m1", "2", "20", "5", "0"],
        ["2026-11-30T23:00:00Z", a.prefix, "alpha", "m2", "1", "7", "1", "0"],
        ["2026-12-01T00:00:00Z", b.prefix, "'=beta", "m1", "4", "100", "50", "0"],
    ]


def test_csv_rows_come_in_batches_in_hour_order() -> None:
    _usage()
    start, end = H - datetime.timedelta(days=7), H + datetime.timedelta(days=1)
    batches = list(usage.iter_usage_rows(start, end, batch=2))
    assert [len(b) for b in batches] == [2, 2, 1]
    hours = [row[0] for batch in batches for row in batch]
    assert hours == sorted(hours) and len(hours) == 5


def _past() -> str:
    return (datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)).isoformat()


def test_create_with_an_expiry_in_the_past_is_refused(operator_client: APIClient) -> None:
    response = operator_client.post("/api/keys", {"name": "x", "expiresAt": _past()}, format="json")
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("expiresAt: ") and "in the past" in error["message"]
    assert not ApiKey.objects.exists()


def test_patch_to_an_expiry_in_the_past_is_refused(operator_client: APIClient) -> None:
    row, _ = keys.create_key(name="app", scopes=["chat"])
    response = operator_client.patch(f"/api/keys/{row.pk}", {"expiresAt": _past()}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("expiresAt: ")
    row.refresh_from_db()
    assert row.expires_at is None
    # Removing the expiry, or one in the future, still works.
    future = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)).isoformat()
    for value in (future, None):
        changed = operator_client.patch(f"/api/keys/{row.pk}", {"expiresAt": value}, format="json")
        assert changed.status_code == 200, changed.json()


def test_patch_that_sends_back_an_expired_keys_own_expiry_is_accepted(
    operator_client: APIClient,
) -> None:
    """A client that GETs a key and PATCHes the whole object back must not be refused."""
    row, _ = keys.create_key(name="app", scopes=["chat"])
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    ApiKey.objects.filter(pk=row.pk).update(expires_at=past)  # it expired since
    response = operator_client.patch(
        f"/api/keys/{row.pk}", {"name": "renamed", "expiresAt": past.isoformat()}, format="json"
    )
    assert response.status_code == 200, response.json()
    row.refresh_from_db()
    assert row.name == "renamed" and row.expires_at == past


@pytest.mark.parametrize("value", ["2026-13-45T00:00:00Z", "2026-02-30T00:00:00+00:00"])
def test_an_impossible_date_is_a_400_not_a_500(operator_client: APIClient, value: str) -> None:
    response = operator_client.post(
        "/api/keys", {"name": "x", "scopes": ["chat"], "expiresAt": value}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("expiresAt:")
