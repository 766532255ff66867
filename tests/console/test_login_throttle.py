"""Failed logins: counted per account and per address, 429 past 10, logged, hashed off-thread.

The login views run Django's view on a thread pool of their own, so these tests use
committed data (``transaction=True``): the pool's threads have their own connections.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.test import AsyncClient, Client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

PASSWORD = "right-password-1"


@pytest.fixture(autouse=True)
def _fast_hasher(settings: object) -> None:
    """A cheap hash: these tests count attempts, not PBKDF2 rounds (100+ logins)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def user(db: object) -> object:
    return get_user_model().objects.create_user("alice", password=PASSWORD, is_staff=True)


@pytest.fixture
def bob(db: object) -> object:
    return get_user_model().objects.create_user("bob", password="bobs-password-1", is_staff=True)


def _post(client: Client, username: str, password: str, *, path: str = "/login/") -> object:
    return client.post(path, {"username": username, "password": password})


def _from(address: str) -> Client:
    return Client(REMOTE_ADDR=address)


def test_the_eleventh_attempt_is_refused_without_checking_the_password(
    user: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _from("10.0.0.1")
    for _ in range(10):
        response = _post(client, "alice", "wrong")
        assert response.status_code == 200  # the form again, with its error
    checked: list[str] = []
    original = ModelBackend.authenticate

    def spy(self: ModelBackend, request: object, **credentials: object) -> object:
        checked.append(str(credentials.get("username")))
        return original(self, request, **credentials)

    monkeypatch.setattr(ModelBackend, "authenticate", spy)
    refused = _post(client, "alice", PASSWORD)  # even the right password
    assert refused.status_code == 429
    retry_after = int(refused["Retry-After"])
    assert 890 <= retry_after <= 900  # the oldest failure leaves the 15-minute window
    assert b"Too many failed logins" in refused.content
    assert checked == []  # no password was checked
    assert not refused.wsgi_request.user.is_authenticated


def test_spellings_that_log_in_as_the_account_share_its_counter(user: object) -> None:
    for i in range(10):
        _post(_from(f"10.3.0.{i}"), "alice", "wrong")
    # Django's form strips and NFKC-normalises the name before authenticate() sees it.
    for spelling in (" alice ", "\uff41lice"):  # fullwidth "a"
        assert _post(_from("10.3.1.1"), spelling, PASSWORD).status_code == 429, spelling


def test_per_address_across_accounts(user: object, bob: object) -> None:
    client = _from("10.0.0.2")
    for i in range(10):
        _post(client, f"nobody-{i}", "guess")  # ten different (unknown) accounts
    assert _post(client, "bob", "bobs-password-1").status_code == 429
    # The accounts themselves are not blocked from elsewhere.
    assert _post(_from("10.0.0.3"), "bob", "bobs-password-1").status_code == 302


def test_per_account_across_addresses(user: object) -> None:
    for i in range(10):
        _post(_from(f"10.1.0.{i}"), "alice", "wrong")
    assert _post(_from("10.2.0.1"), "alice", PASSWORD).status_code == 429


def test_ipv6_addresses_of_one_64_share_a_counter(user: object) -> None:
    for i in range(10):
        _post(_from(f"2001:db8:1:2::{i + 1:x}"), f"x{i}", "guess")
    assert _post(_from("2001:db8:1:2:ffff::1"), "alice", PASSWORD).status_code == 429
    assert _post(_from("2001:db8:1:3::1"), "alice", PASSWORD).status_code == 302


def test_a_success_forgives_only_its_own_failures(user: object, bob: object) -> None:
    client = _from("10.0.0.4")
    for _ in range(5):
        _post(client, "bob", "guess")  # someone at this address guesses bob's password
    for _ in range(4):
        _post(client, "alice", "typo")  # alice mistypes her own
    assert _post(client, "alice", PASSWORD).status_code == 302  # forgives alice's 4
    for _ in range(5):
        assert _post(client, "bob", "guess").status_code == 200  # 6th to 10th of bob's
    # bob's five earlier failures still count for the address: it is blocked now.
    assert _post(client, "alice", PASSWORD).status_code == 429


def test_admin_login_is_throttled_too(user: object) -> None:
    client = _from("10.0.0.5")
    for _ in range(10):
        response = _post(client, "alice", "wrong", path="/admin/login/")
        assert response.status_code == 200
    assert _post(client, "alice", PASSWORD, path="/admin/login/").status_code == 429
    # The console shares the counters: the same account and address are refused there.
    assert _post(client, "alice", PASSWORD).status_code == 429


def test_every_failure_is_logged_without_the_password(
    user: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mirbad.auth")
    client = _from("10.0.0.6")
    for i in range(10):
        _post(client, "alice", f"secret-guess-{i}")
    _post(client, "alice", "secret-guess-last")
    lines = [r.getMessage() for r in caplog.records if r.name == "mirbad.auth"]
    failures = [line for line in lines if line.startswith("Failed login")]
    assert len(failures) == 10
    assert "'alice'" in failures[0] and "10.0.0.6" in failures[0] and "/login/" in failures[0]
    assert "10 failures" in failures[-1]
    assert any(line.startswith("Refused login") for line in lines)
    assert not any("secret-guess" in line for line in lines)


def test_redis_down_fails_open_and_still_logs(
    user: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import redis

    from core import throttle

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    monkeypatch.setattr(throttle, "_redis", lambda: dead)
    caplog.set_level(logging.WARNING, logger="mirbad.auth")
    client = _from("10.0.0.7")
    for _ in range(12):
        assert _post(client, "alice", "wrong").status_code == 200  # never a 429 or a 500
    assert _post(client, "alice", PASSWORD).status_code == 302
    messages = [r.getMessage() for r in caplog.records if r.name == "mirbad.auth"]
    assert sum(m.startswith("Failed login") for m in messages) == 12
    assert sum(m.startswith("Redis unreachable") for m in messages) == 1  # once a minute


async def test_the_password_check_runs_off_the_shared_thread(
    user: object, monkeypatch: pytest.MonkeyPatch, close_db_after: object
) -> None:
    """Under ASGI the sync views share one thread; the PBKDF2 check must not run on it."""
    threads: list[str] = []
    original = ModelBackend.authenticate

    def spy(self: ModelBackend, request: object, **credentials: object) -> object:
        threads.append(threading.current_thread().name)
        return original(self, request, **credentials)

    monkeypatch.setattr(ModelBackend, "authenticate", spy)
    client = AsyncClient(REMOTE_ADDR="10.0.0.8")
    page = await client.get("/login/")
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page.content)
    assert token is not None
    response = await client.post(
        "/login/",
        {"username": "alice", "password": PASSWORD, "csrfmiddlewaretoken": token.group(1).decode()},
    )
    assert response.status_code == 302
    assert threads and all(name.startswith("mirbad-login") for name in threads), threads


def test_a_checked_failure_counts_even_when_the_window_filled_meanwhile(user: object) -> None:
    """Logins that passed the check together are each a real guess: all are counted.

    With nine failures on record, parallel attempts all pass ``login_wait`` and all
    have their password checked; the recording of each must add to the counter.
    """
    from core import throttle

    for _ in range(12):  # the 11th and 12th arrive after the window is full
        throttle.record_login_failure("alice", "10.9.0.1", "/login/")
    keys = throttle._login_keys("alice", "10.9.0.1")
    counts = [throttle._redis().zcard(k) for k in keys]
    assert counts == [12, 12]
