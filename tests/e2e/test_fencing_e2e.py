"""Fencing with real processes: monitor restarts, a standby, a stale master, a takeover."""

from __future__ import annotations

import subprocess
import sys

import httpx
import psutil
import pytest

from tests.e2e import master_db
from tests.e2e.conftest import ROOT, wait_for

pytestmark = pytest.mark.slow


def test_monitor_restart_standby_stale_master_and_takeover(make_stack) -> None:
    stack = make_stack(embedded=False)
    facts = stack.start()
    api = stack.api(facts["API key"], timeout=30)

    def epoch() -> int:  # the identity row every master process reads (D81)
        return master_db.epoch(stack.env)

    def node() -> dict:
        return api.get("/api/nodes/local").json()

    first_epoch = epoch()
    model = api.post(
        "/api/models",
        json={"servedName": "m", "sourceFolder": "m", "sourceFile": "m.gguf", "node": "local"},
    ).json()
    stop_url = f"/api/models/{model['id']}/stop"
    assert api.post(stop_url).status_code == 200  # a mutating agent call, fenced
    monitors: list[subprocess.Popen[bytes]] = []

    def start_monitor(name: str) -> subprocess.Popen[bytes]:
        log = open(stack.data / "logs" / f"{name}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "monitor"],
            cwd=ROOT,
            env=stack.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        monitors.append(proc)
        return proc

    try:
        # kill -9 of the monitor: a new one starts at a higher epoch, the agent accepts it
        # (monitor2, or the launcher's own restart of the one killed).
        psutil.Process(stack.pid("monitor")).kill()
        start_monitor("monitor2")
        wait_for(lambda: epoch() == first_epoch + 1, 30, "the new monitor's epoch")
        assert api.post(stop_url).status_code == 200
        wait_for(
            lambda: (node().get("fencing") or {}).get("epoch") == first_epoch + 1, 20, "accept"
        )
        wait_for(lambda: node()["state"] == "Online", 20, "Online under the new monitor")

        # A second monitor beside the running one waits and drives nothing.
        start_monitor("monitor3")
        wait_for(
            lambda: "Standby" in (stack.data / "logs" / "monitor3.log").read_text(),
            20,
            "the standby's log line",
        )
        assert epoch() == first_epoch + 1

        # The active one dies: the standby takes over within 30 s, at a higher epoch.
        import time

        # The launcher restarts the monitor it supervises, so the one killed first came
        # back beside monitor2 and either of them may hold the lock: monitor2's log says
        # which (it acquired, or it waits as a standby).
        def monitor2_role() -> str:
            text = (stack.data / "logs" / "monitor2.log").read_text()
            return "active" if "Monitor lock acquired" in text else "Standby" in text and "standby"

        if wait_for(monitor2_role, 20, "monitor2 active or standby") == "active":
            monitors[0].kill()
            monitors[0].wait(timeout=10)
        else:
            psutil.Process(stack.pid("monitor")).kill()  # the launcher's, back or not
        died = time.monotonic()
        wait_for(lambda: epoch() == first_epoch + 2, 30, "the standby taking over")
        print(f"standby took over {time.monotonic() - died:.1f} s after the active monitor died")
        assert api.post(stop_url).status_code == 200
        wait_for(
            lambda: (node().get("fencing") or {}).get("epoch") == first_epoch + 2, 20, "accept"
        )
        wait_for(lambda: node()["state"] == "Online", 20, "Online under the standby")

        # An old identity: the row restored with a lower epoch.
        master_db.set_epoch(stack.env, first_epoch - 1 if first_epoch > 1 else 0)
        answers = [api.post(stop_url) for _ in range(20)]
        assert all(a.status_code == 503 for a in answers), [a.status_code for a in answers]
        assert {a.json()["error"]["code"] for a in answers} == {"stale_master"}
        wait_for(lambda: node()["state"] == "PendingTakeover", 20, "PendingTakeover")
        v1 = httpx.post(
            f"{stack.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {facts['API key']}"},
            json={"model": "m", "messages": []},
        )
        assert v1.status_code == 503 and v1.json()["error"]["code"] == "node_offline"

        # The operator's explicit takeover raises the epoch above the agent's.
        record = api.post("/api/takeover").json()
        assert record["epoch"] > first_epoch + 2 and record["nodes"]["local"] == first_epoch + 2
        wait_for(lambda: node()["state"] == "Online", 20, "Online after the takeover")
        assert api.post(stop_url).status_code == 200
    finally:
        for proc in monitors:
            proc.terminate()
        for proc in monitors:
            proc.wait(timeout=30)
