"""Two master hosts on one database (issue 15, "A standby on another host"; D80, D81).

Host A and host B are two `mirbad up` stacks with their own data directories, on
one PostgreSQL database and one Redis; B is given A's master key (the value of
A's generated ``master.key``) and its own bootstrap node id. Both serve `/v1`.
The active monitor (A's) is killed -9 while `/v1` requests keep arriving; B's
standby monitor drives the fleet within 30 s at a higher epoch. No agent
re-enrolls (its identity files are unchanged) and no engine restarts (the same
process serves).
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from tests.e2e import master_db
from tests.e2e.conftest import create_and_start, llama_server_or_fail, wait_for

pytestmark = pytest.mark.slow

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _ready_instance(api: httpx.Client, node_id: str) -> dict | None:  # type: ignore[type-arg]
    instances = api.get(f"/api/nodes/{node_id}").json().get("instances") or []
    return next((i for i in instances if i.get("state") == "Ready"), None)


def test_a_standby_on_another_host_takes_over_the_fleet(make_stack) -> None:  # type: ignore[no-untyped-def]
    llama_server_or_fail()
    a = make_stack(embedded=False)
    if not a.env.get("MIRBAD_DATABASE_URL", "").startswith(("postgres://", "postgresql://")):
        pytest.skip("two master hosts share a PostgreSQL database (MIRBAD_DATABASE_URL)")
    b = make_stack(embedded=False)  # built before A starts: a shared Redis is emptied here
    a.prepare_local_model()
    facts = a.start()
    key = facts["API key"]
    api_a = a.api(key, timeout=60)
    model_id = create_and_start(
        api_a,
        {
            "servedName": "tiny", "sourceFolder": "tiny", "sourceFile": "tiny.gguf",
            "settings": {"context_size": 256, "parallel": 1, "gpu_layers": 0}, "node": "local",
        },
    )  # fmt: skip
    before = _ready_instance(api_a, "local")
    assert before is not None
    identity = a.data / "agent" / "state"
    files = {p.name: p.read_bytes() for p in identity.iterdir() if p.suffix in (".crt", ".key")}
    assert files, "the local agent's identity files"

    # Host B: the same database, Redis and master key; its own bootstrap node.
    for name in ("MIRBAD_DATABASE_URL", "MIRBAD_REDIS_URL"):
        b.env[name] = a.env[name]
    b.env["MIRBAD_MASTER_KEY"] = (a.data / "master.key").read_text().strip()
    b.env["MIRBAD_BOOTSTRAP_NODE_ID"] = "host-b"
    b.start()
    assert (b.data / "pki" / "ca.crt").read_bytes() == (a.data / "pki" / "ca.crt").read_bytes()
    api_b = b.api(key, timeout=60)
    wait_for(lambda: api_b.get("/api/nodes/host-b").json()["state"] == "Online", 60, "B's node")
    b_monitor_log = b.data / "logs" / "monitor.log"
    wait_for(lambda: "Standby" in b_monitor_log.read_text(), 30, "B's monitor waiting")
    for url in (a.url, b.url):  # both hosts serve /v1
        answer = httpx.post(
            f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json=BODY, timeout=60,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
    first_epoch = master_db.epoch(a.env)

    # /v1 traffic through both hosts while the active monitor dies.
    stop = threading.Event()
    codes: list[int] = []

    def traffic() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            while not stop.is_set():
                for url in (a.url, b.url):
                    try:
                        codes.append(
                            client.post(f"{url}/v1/chat/completions", json=BODY).status_code
                        )
                    except httpx.HTTPError:
                        codes.append(0)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        time.sleep(2)
        psutil.Process(a.pid("monitor")).kill()
        died = time.monotonic()
        wait_for(lambda: master_db.epoch(a.env) > first_epoch, 30, "a monitor at a higher epoch")
        wait_for(lambda: "Monitor lock acquired" in b_monitor_log.read_text(), 5, "B's monitor")
        # B's monitor follows the fleet: its workers connect and write the node Online.
        wait_for(
            lambda: "Node local: Offline -> Online" in b_monitor_log.read_text(),
            30 - (time.monotonic() - died),
            "B's monitor driving node local",
        )
        took = time.monotonic() - died
        print(f"host B's monitor drove the fleet {took:.1f} s after host A's monitor died")
        assert took <= 30
        assert api_b.get("/api/nodes/local").json()["state"] == "Online"
        time.sleep(2)  # /v1 goes on under the new monitor
    finally:
        stop.set()
        thread.join(timeout=90)
    # /v1 never failed: the routers of both hosts kept serving through the takeover.
    assert codes and set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
    # No engine restarted: the instance Ready before is the same process.
    now = _ready_instance(api_b, "local")
    assert now is not None and now["pid"] == before["pid"]
    assert now["instanceId"] == before["instanceId"]
    # No agent re-enrolled: its identity files are the ones it had.
    after = {p.name: p.read_bytes() for p in identity.iterdir() if p.suffix in (".crt", ".key")}
    assert after == files
    # A fenced mutation through host A's web carries the new epoch; the agent accepts it.
    assert api_a.post(f"/api/models/{model_id}/stop").status_code == 200
    wait_for(
        lambda: (
            (api_b.get("/api/nodes/local").json().get("fencing") or {}).get("epoch", 0)
            == master_db.epoch(a.env)
        ),
        20,
        "the agent accepting the new epoch",
    )
    assert master_db.epoch(a.env) > first_epoch
