"""Shared fixtures: personas, a clean status cache, certificates for TLS tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from router import keys

# Tests make hundreds of users and sessions; production's PBKDF2 (a million rounds, about
# half a second of CPU each) proves nothing there. tests/test_password_hasher.py holds
# production's hasher and its cost; the e2e stacks run production's settings.
FAST_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def pytest_configure(config: pytest.Config) -> None:
    from django.conf import settings

    settings.PASSWORD_HASHERS = FAST_HASHERS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first, the longest of them first (``SLOWEST_FILES``), the rest in
    file order: the xdist workers then start on the few long tests and fill in with the
    many short ones, so no worker is left with a long test at the end."""
    import os

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process: file order, as the suite has always run
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}

    def key(item: pytest.Item) -> tuple[int, int]:
        if item.get_closest_marker("slow") is None:
            return (1, 0)
        return (0, rank.get(item.path.name, len(rank)))

    items.sort(key=key)  # stable: file order within each rank


# The e2e files whose tests take longest (a minute or more each on this machine class;
# `./mirbad test --durations=40` prints the current figures).
SLOWEST_FILES = (
    "test_compose.py",
    "test_rotation_agent_crashes.py",
    "test_rotation_master_crashes.py",
    "test_v1_reused_connections.py",
    "test_master_cert_lifetimes.py",
    "test_ondemand_e2e.py",
    "test_console_browser.py",
    "test_partition.py",
    "test_console_pages_browser.py",
    "test_cert_rotation_e2e.py",
    "test_api_fuzz.py",
    "test_up_supervision.py",
    "test_listener_limits.py",
)


@pytest.fixture(scope="module")
def podman_serial() -> Iterator[None]:
    """One module at a time across the xdist workers uses Podman (tests/containers.py)."""
    from tests.containers import podman_serial_lock

    with podman_serial_lock():
        yield


@pytest.fixture
def operator(db):
    """A console user allowed to operate the fleet (staff)."""
    return get_user_model().objects.create_user("operator", password="pw-operator-1", is_staff=True)


@pytest.fixture
def viewer(db):
    """A logged-in user without operator rights."""
    return get_user_model().objects.create_user("viewer", password="pw-viewer-1")


@pytest.fixture
def operator_client(operator) -> APIClient:
    client = APIClient()
    client.force_authenticate(operator)
    return client


@pytest.fixture
def viewer_client(viewer) -> APIClient:
    client = APIClient()
    client.force_authenticate(viewer)
    return client


@pytest.fixture
def anon_client() -> APIClient:
    return APIClient()


@pytest.fixture
def chat_key(db) -> str:
    """A /v1 key with the chat scope only (no admin)."""
    _, key = keys.create_key(name="chat", scopes=["chat", "completions", "embeddings"])
    return key


@pytest.fixture
def admin_key(db) -> str:
    _, key = keys.create_key(name="admin", scopes=["admin", "chat"])
    return key


@pytest.fixture
def status_redis():
    """The status cache's Redis, emptied before and after the test."""
    from nodes import status_cache

    client = status_cache.sync_client()
    for key in client.scan_iter(f"{status_cache.KEY_PREFIX}*"):
        client.delete(key)
    yield client
    for key in client.scan_iter(f"{status_cache.KEY_PREFIX}*"):
        client.delete(key)


@pytest.fixture
async def close_db_after():
    """Async tests reach the ORM through sync_to_async's thread; close its connection after."""
    yield
    from asgiref.sync import sync_to_async
    from django.db import connections

    await sync_to_async(connections.close_all)()


@pytest.fixture
def master_identity(db):
    """The identity as a started monitor leaves it (the database row, nodes/fencing.py)."""
    from django.conf import settings

    from nodes import fencing
    from nodes.models import MasterState

    MasterState.objects.all().delete()
    fencing.forget()
    identity = fencing.begin_epoch(settings.MIRBAD.data_path)
    yield identity
    fencing.forget()


@pytest.fixture(autouse=True)
def _no_cached_identity():
    """Each process caches the master's identity for a second (nodes/fencing.py); each
    test's database starts without one, so its cache does too."""
    from nodes import fencing

    fencing.forget()
    yield


@pytest.fixture(autouse=True)
def _status_reads_not_paused():
    """A test that makes Redis fail pauses this process's status reads for a while
    (nodes/status_cache.py): the next test starts with live reads, whatever ran before."""
    from nodes import status_cache

    status_cache.forget()
    yield


@pytest.fixture(autouse=True)
def _no_failures_counted():
    """Failed logins and key lookups are counted in Redis across requests (and so across
    tests, all from 127.0.0.1): each test starts with none (core.throttle)."""
    import contextlib

    from redis.exceptions import RedisError

    from core import throttle

    with contextlib.suppress(RedisError, OSError):
        throttle.reset()
    yield


@pytest.fixture(autouse=True)
def _fresh_channel_layer() -> object:
    """Each test gets its own channel layer.

    channels_redis keeps its locks and pools bound to the event loop that made them, and
    every async test runs on a new loop: a receive lock left held by a listener that an
    earlier test cancelled made every later listener fail ("bound to a different event
    loop") and rejoin, which drops a router's caches. A process in production has one
    loop; the tests get what it gets.
    """
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()
