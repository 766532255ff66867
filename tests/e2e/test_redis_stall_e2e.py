"""A real ``./mirbad up --demo`` with its Redis stopped (SIGSTOP) for 10 s.

/v1 keeps serving the demo model from the router's caches, ``/api/nodes`` and
the console answer 200 with the last known statuses, marked as such; after
SIGCONT the statuses are live again. The latencies seen are printed.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import psutil
import pytest

from tests.e2e.conftest import Stack, llama_server_or_fail, wait_for

pytestmark = pytest.mark.slow

STALL_SECONDS = 10.0
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _console(url: str, admin: str) -> httpx.Client:
    """A console session logged in as the printed admin."""
    user, password = admin.split()[:2]
    client = httpx.Client(base_url=url, timeout=30)
    login = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text)
    assert token, login.text
    answer = client.post(
        "/login/",
        data={"username": user, "password": password, "csrfmiddlewaretoken": token.group(1)},
    )
    assert answer.status_code == 302, answer.text
    return client


def _timed(call, *args, **kwargs):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    response = call(*args, **kwargs)
    took = time.monotonic() - started
    print(
        f"{time.strftime('%H:%M:%S')} {response.request.url.path} {response.status_code} "
        f"{took * 1000:.0f} ms (router {response.headers.get('x-mirbad-overhead-ms', '-')} ms)"
    )
    return response, took


def _redis_pid(stack: Stack) -> int:
    """The stack's embedded redis-server (its pid file, else the one serving its data dir)."""
    pid_file = stack.data / "run" / "redis.pid"
    if pid_file.exists():
        return int(pid_file.read_text())
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "redis-server" in cmdline and str(stack.data) in cmdline:
            return proc.pid
    raise AssertionError("the stack's redis-server was not found")


def _router_seconds(response: httpx.Response) -> float:
    """The router's own time (x-mirbad-overhead-ms): Redis waits show here, engine time not."""
    return float(response.headers["x-mirbad-overhead-ms"]) / 1000


def test_a_redis_stall_keeps_v1_console_and_api_answering(make_stack) -> None:  # type: ignore[no-untyped-def]
    llama_server_or_fail()
    stack = make_stack(embedded=True)
    facts = stack.start("--demo")
    api = stack.api(facts["API key"], timeout=30)
    console = _console(stack.url, facts["Admin"])
    for _ in range(3):  # the router has read the node's status, as in a running master
        assert _timed(api.post, "/v1/chat/completions", json=CHAT)[0].status_code == 200
    assert api.get("/api/nodes").json()["stale"] is False
    assert 'id="redis-banner"' not in console.get("/").text

    redis_pid = _redis_pid(stack)
    chats: list[float] = []
    router: list[float] = []
    os.kill(redis_pid, signal.SIGSTOP)
    stalled_at = time.monotonic()
    try:
        time.sleep(2.5)  # past the router's status TTL and its stale window: a read is due
        answer, first = _timed(api.post, "/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        chats.append(first)
        router.append(_router_seconds(answer))
        nodes, nodes_s = _timed(api.get, "/api/nodes")
        assert nodes.status_code == 200, nodes.text
        body = nodes.json()
        assert body["stale"] is True, body
        local = body["nodes"][0]
        assert local["statusSource"] == "last-known" and local["state"] == "Online", local
        page, page_s = _timed(console.get, "/")
        assert page.status_code == 200
        assert 'id="redis-banner"' in page.text and "last known as of" in page.text
        while time.monotonic() - stalled_at < STALL_SECONDS:
            answer, took = _timed(api.post, "/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200, answer.text
            chats.append(took)
            router.append(_router_seconds(answer))
            time.sleep(0.5)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    print(
        f"Redis stopped {STALL_SECONDS:.0f} s: first /v1 chat {first * 1000:.0f} ms "
        f"(router {router[0] * 1000:.0f} ms); {len(chats)} chats, max {max(chats) * 1000:.0f} ms, "
        f"router max after the first {max(router[1:]) * 1000:.1f} ms; "
        f"/api/nodes {nodes_s * 1000:.0f} ms, console {page_s * 1000:.0f} ms"
    )
    # The router waits for the stalled Redis once, for the status timeout (0.5 s), then
    # serves the last known status at once. The rest of a chat is the agent and the
    # engine, which a loaded 2-core machine can slow down: bounded loosely.
    assert router[0] < 1.0 and max(router[1:]) < 0.4, router
    assert max(chats) < 5.0, chats
    assert nodes_s < 1.5 and page_s < 1.5, (nodes_s, page_s)
    # Redis back: live statuses again within the status reads' retry delay (and the monitor's step).
    wait_for(lambda: api.get("/api/nodes").json()["stale"] is False, 15, "live statuses")
    assert 'id="redis-banner"' not in console.get("/").text
    assert api.post("/v1/chat/completions", json=CHAT).status_code == 200
