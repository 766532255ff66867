"""The console's keys page: operators only, the new key shown once, revoke by POST."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import AbstractUser
from django.test import Client

from router import keys
from router.models import ApiKey

pytestmark = pytest.mark.django_db


def _logged_in(user: AbstractUser) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_needs_an_operator_login(viewer: AbstractUser) -> None:
    for client in (Client(), _logged_in(viewer)):
        response = client.get("/keys/")
        assert response.status_code == 302 and response["Location"].startswith("/login/")
        assert client.post("/keys/", {"name": "x", "scopes": ["chat"]}).status_code == 302
    assert not ApiKey.objects.exists()


def test_create_redirects_and_shows_the_key_once(operator: AbstractUser) -> None:
    client = _logged_in(operator)
    page = client.get("/keys/")
    assert page.status_code == 200 and b"No keys yet" in page.content
    created = client.post(
        "/keys/",
        {"name": "webapp", "scopes": ["chat", "embeddings"], "models": "m1, m2",
         "expires_at": "2030-01-01T12:00", "rpm_limit": "60", "tpm_limit": "",
         "concurrency_limit": "3"},
    )  # fmt: skip
    # Post/redirect/get: the key is not in the POST's answer nor in its Location.
    assert created.status_code == 302 and created["Location"] == "/keys/"
    row = ApiKey.objects.get()
    assert row.prefix.encode() not in created.content
    shown = client.get("/keys/")
    assert shown.status_code == 200
    plaintext = shown.context["created"]["key"]
    assert plaintext.startswith("mbd-") and plaintext not in created["Location"]
    assert f'<code id="new-key-value">{plaintext}</code>'.encode() in shown.content
    assert b'data-copy-target="#new-key-value"' in shown.content
    assert "no-store" in shown["Cache-Control"]
    assert keys.hash_key(plaintext) == row.key_hash
    assert row.scopes == ["chat", "embeddings"] and row.model_allowlist == ["m1", "m2"]
    assert (row.rpm_limit, row.tpm_limit, row.concurrency_limit) == (60, None, 3)
    assert row.expires_at is not None and row.expires_at.isoformat() == "2030-01-01T12:00:00+00:00"
    # The reload: the key is not shown again and no second key is created.
    listed = client.get("/keys/")
    assert plaintext.encode() not in listed.content and listed.context["created"] is None
    assert b'id="new-key"' not in listed.content
    assert row.prefix.encode() in listed.content and b"60 req/min" in listed.content
    assert ApiKey.objects.count() == 1
    # Nor is it left in the session, where a later page could read it.
    assert plaintext not in str(dict(client.session))


def test_the_secret_goes_only_to_the_session_that_created_it(operator: AbstractUser) -> None:
    creator, other = _logged_in(operator), _logged_in(operator)
    assert _create(creator).status_code == 302
    assert other.get("/keys/").context["created"] is None
    assert creator.get("/keys/").context["created"]["name"] == "one"


def _create(client: Client) -> Any:
    return client.post("/keys/", {"name": "one", "scopes": ["chat"]})


def test_copy_buttons_for_the_base_url_and_the_example(operator: AbstractUser) -> None:
    page = _logged_in(operator).get("/keys/")
    html = page.content.decode()
    assert '<code id="base-url">http://testserver/v1</code>' in html
    assert 'data-copy-target="#base-url"' in html and 'data-copy-target="#example-curl"' in html
    assert "curl http://testserver/v1/chat/completions" in html and "$MIRBAD_API_KEY" in html
    assert "/static/console/copy.js" in html and "onclick" not in html


def test_invalid_form_creates_nothing(operator: AbstractUser) -> None:
    client = _logged_in(operator)
    response = client.post("/keys/", {"name": "x", "scopes": ["chat"], "rpm_limit": "0"})
    assert response.status_code == 400 and b"Requests per minute:" in response.content
    response = client.post("/keys/", {"name": "x"})
    assert b"This field is required" in response.content
    assert not ApiKey.objects.exists()


def test_revoke_by_post(operator: AbstractUser) -> None:
    row, _ = keys.create_key(name="old", scopes=["chat"])
    client = _logged_in(operator)
    assert client.get(f"/keys/{row.pk}/revoke/").status_code == 405
    response = client.post(f"/keys/{row.pk}/revoke/")
    assert response.status_code == 302 and response["Location"] == "/keys/"
    row.refresh_from_db()
    assert row.revoked_at is not None
    assert b"revoked" in client.get("/keys/").content
    assert client.post("/keys/99999/revoke/").status_code == 404


def test_an_expiry_in_the_past_is_refused_at_its_field(operator: AbstractUser) -> None:
    client = _logged_in(operator)
    response = client.post(
        "/keys/", {"name": "x", "scopes": ["chat"], "expires_at": "2020-01-01T12:00"}
    )
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert list(errors) == ["expires_at"] and "in the past" in errors["expires_at"][0]
    assert b"2020-01-01T12:00:00+00:00 is in the past" in response.content
    assert not ApiKey.objects.exists()
