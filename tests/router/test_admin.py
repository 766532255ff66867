"""The Django admin for keys and usage: no add, changes through router.keys, usage read-only (D60)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from router import keys
from router.models import ApiKey, UsageRecord

pytestmark = pytest.mark.django_db

KEYS = "/admin/router/apikey/"
USAGE = "/admin/router/usagerecord/"


@pytest.fixture
def admin_client() -> Client:
    """A staff superuser logged in to the Django admin."""
    user = get_user_model().objects.create_user(
        "root", password="pw-root-1", is_staff=True, is_superuser=True
    )
    client = Client()
    client.force_login(user)
    return client


def _form(row: ApiKey, **changes: Any) -> dict[str, Any]:
    """The key's change form as a browser posts it."""
    form: dict[str, Any] = {
        "name": row.name,
        "model_allowlist": "[]",
        "expires_at_0": "",
        "expires_at_1": "",
        "rpm_limit": "",
        "tpm_limit": "",
        "concurrency_limit": "",
        "priority": "0",
        "queue_timeout_seconds": "",
        "daily_token_budget": "",
        "monthly_token_budget": "",
        "budget_timezone": "UTC",
    }
    form.update(changes)
    return form


def _listed(client: Client, url: str, names: tuple[str, ...]) -> set[str]:
    page = client.get(url)
    assert page.status_code == 200, page.status_code
    return {n for n in names if f">{n}</a>" in page.content.decode()}


def test_keys_are_not_added_in_the_admin(admin_client: Client) -> None:
    """Adding would make a key without a secret: the add page is refused, not offered."""
    assert admin_client.get(f"{KEYS}add/").status_code == 403
    answer = admin_client.post(
        f"{KEYS}add/", {"name": "x", "key_hash": "0" * 64, "prefix": "mbd-x"}
    )
    assert answer.status_code == 403
    assert not ApiKey.objects.exists()
    assert b'href="/admin/router/apikey/add/"' not in admin_client.get(KEYS).content


def test_a_change_goes_through_router_keys_and_the_key_still_works(admin_client: Client) -> None:
    row, key = keys.create_key(name="ci", scopes=["chat"])
    answer = admin_client.post(
        f"{KEYS}{row.pk}/change/",
        _form(row, name="  ci runner  ", model_allowlist='["b", "a", " a "]', rpm_limit="30"),
    )
    assert answer.status_code == 302, answer.content[:2000]
    info = keys.lookup(key)
    assert info is not None  # the secret is untouched: the key still authenticates
    assert (info.rpm_limit, info.model_allowlist) == (30, frozenset({"a", "b"}))
    after = ApiKey.objects.get(pk=row.pk)
    # router.keys cleaned them as PATCH /api/keys does: trimmed, sorted, deduplicated.
    assert (after.name, after.model_allowlist, after.key_hash) == (
        "ci runner",
        ["a", "b"],
        row.key_hash,
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model_allowlist": "5"}, "model_allowlist"),
        ({"model_allowlist": '{"m": 1}'}, "model_allowlist"),
        ({"model_allowlist": '["ok", 3]'}, "model_allowlist"),
        ({"expires_at_0": "2001-01-01", "expires_at_1": "00:00:00"}, "expires_at"),
        ({"rpm_limit": "0"}, "rpm_limit"),
        ({"tpm_limit": "-1"}, "tpm_limit"),
        ({"concurrency_limit": str(2**40)}, "concurrency_limit"),
        ({"name": "   "}, "name"),
        ({"priority": "5000"}, "priority"),
        ({"queue_timeout_seconds": "90000"}, "queue_timeout_seconds"),
        ({"daily_token_budget": "0"}, "daily_token_budget"),
        ({"budget_timezone": "Mars/Olympus"}, "budget_timezone"),
    ],
)
def test_what_patch_refuses_the_change_form_refuses(
    admin_client: Client, changes: dict[str, str], field: str
) -> None:
    row, key = keys.create_key(name="ci", scopes=["chat"])
    answer = admin_client.post(f"{KEYS}{row.pk}/change/", _form(row, **changes))
    assert answer.status_code == 200, answer.status_code  # the form again, never a 500
    assert field in answer.context["adminform"].form.errors
    after = ApiKey.objects.get(pk=row.pk)
    assert (after.name, after.model_allowlist, after.expires_at) == ("ci", [], None)
    assert (after.rpm_limit, after.tpm_limit, after.concurrency_limit) == (None, None, None)
    assert keys.lookup(key) is not None


def test_secret_scopes_and_revocation_are_read_only(admin_client: Client) -> None:
    row, key = keys.create_key(name="k", scopes=["chat"])
    admin_client.post(
        f"{KEYS}{row.pk}/change/",
        _form(row, key_hash=keys.hash_key("mbd-mine"), prefix="mbd-mine", scopes='["admin"]',
              revoked_at_0="2020-01-01", revoked_at_1="00:00:00"),
    )  # fmt: skip
    after = ApiKey.objects.get(pk=row.pk)
    assert (after.key_hash, after.prefix, after.scopes) == (row.key_hash, row.prefix, ["chat"])
    assert after.revoked_at is None
    assert keys.lookup("mbd-mine") is None and keys.lookup(key) is not None
    page = admin_client.get(f"{KEYS}{row.pk}/change/").content.decode()
    assert key not in page  # the secret was shown once, at creation, and never again


def test_keys_are_revoked_not_deleted(admin_client: Client) -> None:
    row, key = keys.create_key(name="k", scopes=["chat"])
    assert admin_client.get(f"{KEYS}{row.pk}/delete/").status_code == 403
    assert admin_client.post(f"{KEYS}{row.pk}/delete/", {"post": "yes"}).status_code == 403
    admin_client.post(KEYS, {"action": "delete_selected", "_selected_action": [str(row.pk)]})
    assert ApiKey.objects.filter(pk=row.pk).exists()
    admin_client.post(KEYS, {"action": "revoke", "_selected_action": [str(row.pk)]})
    assert ApiKey.objects.get(pk=row.pk).revoked_at is not None
    assert keys.lookup(key) is None


def test_the_key_list_searches_and_filters_by_state(admin_client: Client) -> None:
    active, _ = keys.create_key(name="active-one", scopes=["chat"])
    revoked, _ = keys.create_key(name="revoked-one", scopes=["chat"])
    keys.revoke_key(revoked.pk)
    expired, _ = keys.create_key(name="expired-one", scopes=["chat"])
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - dt.timedelta(days=1))
    names = ("active-one", "revoked-one", "expired-one")
    assert _listed(admin_client, f"{KEYS}?state=active", names) == {"active-one"}
    assert _listed(admin_client, f"{KEYS}?state=revoked", names) == {"revoked-one"}
    assert _listed(admin_client, f"{KEYS}?state=expired", names) == {"expired-one"}
    assert _listed(admin_client, f"{KEYS}?q={active.prefix}", names) == {"active-one"}
    assert _listed(admin_client, f"{KEYS}?q=revoked", names) == {"revoked-one"}
    page = admin_client.get(KEYS).content.decode()
    assert "Revoked" in page and "Expired" in page and "Active" in page


@pytest.mark.parametrize(
    "query",
    ["?q=%25%27%22%3Cscript%3E", "?q=" + "z" * 3000, "?state=nonsense", "?q=%F0%9F%92%A3",
     "?created_at__gte=yesterday", "?o=abc"],
)  # fmt: skip
@pytest.mark.parametrize("url", [KEYS, USAGE])
def test_odd_list_queries_never_500(admin_client: Client, url: str, query: str) -> None:
    row, _ = keys.create_key(name="k", scopes=["chat"])
    UsageRecord.objects.create(key=row, key_prefix=row.prefix, model="m1", hour=timezone.now())
    answer = admin_client.get(f"{url}{query}")
    assert answer.status_code in (200, 302), answer.content[:500]


def test_usage_is_listed_searched_filtered_and_read_only(admin_client: Client) -> None:
    alpha, _ = keys.create_key(name="alpha", scopes=["chat"])
    beta, _ = keys.create_key(name="beta", scopes=["chat"])
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    one = UsageRecord.objects.create(
        key=alpha, key_prefix=alpha.prefix, model="llama-8b", hour=hour, requests=3
    )
    UsageRecord.objects.create(key=beta, key_prefix=beta.prefix, model="qwen-7b", hour=hour)

    def models(query: str) -> set[str]:
        page = admin_client.get(f"{USAGE}{query}")
        assert page.status_code == 200
        body = page.content.decode()
        return {m for m in ("llama-8b", "qwen-7b") if f'class="field-model">{m}<' in body}

    assert models("") == {"llama-8b", "qwen-7b"}
    assert models("?q=alpha") == {"llama-8b"}  # by the key's name
    assert models(f"?q={beta.prefix}") == {"qwen-7b"}
    assert models("?model=qwen-7b") == {"qwen-7b"}
    assert models(f"?key__id__exact={alpha.pk}") == {"llama-8b"}
    assert models(f"?hour__year={hour.year}&hour__month={hour.month}") == {"llama-8b", "qwen-7b"}
    assert admin_client.get(f"{USAGE}add/").status_code == 403
    assert admin_client.post(f"{USAGE}{one.pk}/delete/", {"post": "yes"}).status_code == 403
    admin_client.post(f"{USAGE}{one.pk}/change/", {"requests": "999"})
    assert UsageRecord.objects.get(pk=one.pk).requests == 3


@pytest.mark.parametrize("url", [KEYS, USAGE, f"{KEYS}add/"])
def test_keys_and_usage_refuse_anyone_but_staff(url: str, viewer: Any, admin_key: str) -> None:
    keys.create_key(name="secret-key", scopes=["chat"])
    non_staff = Client()
    non_staff.force_login(viewer)
    # An API key with the admin scope is for /api, not for the Django admin.
    bearer = Client().get(url, HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    for answer in (Client().get(url), non_staff.get(url), bearer):
        assert answer.status_code == 302 and answer["Location"].startswith("/admin/login/")
        assert b"secret-key" not in answer.content
    row = ApiKey.objects.get(name="secret-key")
    non_staff.post(KEYS, {"action": "revoke", "_selected_action": [str(row.pk)]})
    assert ApiKey.objects.get(pk=row.pk).revoked_at is None


def test_the_change_form_sets_budgets(admin_client: Client) -> None:
    row, key = keys.create_key(name="ci", scopes=["chat"])
    answer = admin_client.post(
        f"{KEYS}{row.pk}/change/",
        _form(row, daily_token_budget="5000", budget_timezone="Asia/Kolkata", priority="-3"),
    )
    assert answer.status_code == 302, answer.content[:2000]
    info = keys.lookup(key)
    assert info is not None
    assert (info.daily_token_budget, info.budget_timezone, info.priority) == (
        5000,
        "Asia/Kolkata",
        -3,
    )
