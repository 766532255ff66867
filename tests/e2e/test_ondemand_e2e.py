"""Load on demand and idle unload end to end: a real stack, real llama-server processes.

Two tiny models on the one local node, both ``loadOnDemand``, and the node's memory
reserve set so that only one fits at a time. Each model keeps a 2 GiB KV cache
(``context_size`` 4M tokens of the tiny model: llama.cpp clears the cache at load,
so the memory is really used), and the reserve leaves the budget of one plus 40 %
free: the second does not fit beside the first. Alternate requests then load one and
unload the other each time; none fails, and each swap's time is printed and logged.
A streamed request that starts a load gets SSE comment lines, then the answer. Last,
``idleUnloadSeconds`` unloads the loaded model by itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import llama_server_or_fail, wait_for

pytestmark = pytest.mark.slow

BIG_CONTEXT = 4_194_304  # x 512 B a token of the tiny model's KV = 2 GiB


def _model(name: str) -> dict[str, Any]:
    return {
        "servedName": name,
        "sourceFolder": "tiny",
        "sourceFile": "tiny.gguf",
        "settings": {"context_size": BIG_CONTEXT, "gpu_layers": 0},
        "node": "local",
        "loadOnDemand": True,
        "loadTimeoutSeconds": 120,
    }


def _state(api: httpx.Client, model_id: int) -> str:
    return str(api.get(f"/api/models/{model_id}").json()["state"])


def _ask(stack: Any, key: str, model: str) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = httpx.post(
        f"{stack.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=180,
    )
    return response, time.monotonic() - began


def test_two_models_take_turns_on_a_node_with_room_for_one(make_stack, tmp_path: Path) -> None:
    llama_server_or_fail()
    # Its own Redis and database: stacks of other tests share the configured Redis's db 2,
    # and the node id "local" with it.
    stack = make_stack(embedded=True)
    stack.prepare_local_model()
    facts = stack.start()
    api = stack.api(facts["API key"], timeout=120)
    try:
        run(stack, api)
    except BaseException:
        stack.print_logs()
        raise


def run(stack: Any, api: httpx.Client) -> None:
    ids = {}
    for name in ("tiny-a", "tiny-b"):
        created = api.post("/api/models", json=_model(name))
        assert created.status_code == 201, created.text
        ids[name] = created.json()["id"]
    key = api.post("/api/keys", json={"name": "app", "scopes": ["chat"]}).json()["key"]

    # -- a node with room for one: the reserve leaves one budget and 40 % free ---------
    assert api.patch("/api/nodes/local", json={"memoryReserveBytes": 0}).status_code == 200
    estimate = api.get(f"/api/models/{ids['tiny-a']}/estimate").json()["placements"][0]
    budget = estimate["budgetBytes"]
    available = estimate["lines"][0]["freeAfterReserveBytes"]
    reserve = available - int(budget * 1.4)
    assert reserve > 0, (available, budget)
    assert api.patch("/api/nodes/local", json={"memoryReserveBytes": reserve}).status_code == 200
    print(f"\nbudget {budget / 2**30:.2f} GiB each; free after the reserve "
          f"{(available - reserve) / 2**30:.2f} GiB")  # fmt: skip

    # -- alternate requests: each loads its model, the other is stopped for room -------
    swaps: list[tuple[str, float]] = []
    for turn, name in enumerate(["tiny-a", "tiny-b", "tiny-a", "tiny-b"]):
        other = "tiny-b" if name == "tiny-a" else "tiny-a"
        response, seconds = _ask(stack, key, name)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == name
        assert _state(api, ids[name]) == "Ready"
        if turn:
            swaps.append((f"{other} -> {name}", seconds))
            stopped = api.get(f"/api/models/{ids[other]}").json()
            assert stopped["state"] == "Stopped", stopped
            assert f"made room for '{name}'" in (stopped["autoStartNote"] or ""), stopped
        # Loaded now: the next request for it does not wait.
        again, _ = _ask(stack, key, name)
        assert again.status_code == 200, again.text
    for what, seconds in swaps:
        print(f"swap {what}: {seconds:.1f} s")
    events = api.get("/api/audit", params={"action": "model.unloaded"}).json()
    rows = events.get("events") or events.get("results") or []
    assert len([e for e in rows if (e.get("detail") or {}).get("reason") == "room"]) >= 3, events

    # -- a stream that starts a load: comment lines while it waits, then the answer ----
    lines: list[str] = []
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny-a", "messages": [{"role": "user", "content": "x"}],
              "max_tokens": 2, "stream": True},
        timeout=180,
    ) as streamed:  # fmt: skip
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        for line in streamed.iter_lines():
            lines.append(line)
    comments = [line for line in lines if line.startswith(":")]
    assert comments and all(c == ": loading tiny-a" for c in comments), lines[:10]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", lines[-5:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert lines.index(comments[-1]) < lines.index(next(x for x in lines if x.startswith("data")))
    print(f"stream: {len(comments)} comment line(s) before the answer")

    # -- the swap times are in the router's log ----------------------------------------
    logged = [
        line
        for log in sorted((stack.data / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "on demand in" in line
    ]
    assert len([line for line in logged if "to make room" in line]) >= 4, logged
    for line in logged:
        print(line)

    # -- idle unload: the loaded model goes by itself ---------------------------------
    patched = api.patch(f"/api/models/{ids['tiny-a']}", json={"idleUnloadSeconds": 10})
    assert patched.status_code == 200, patched.text
    wait_for(lambda: _state(api, ids["tiny-a"]) == "Stopped", 60, "the idle unload of tiny-a")
    note = api.get(f"/api/models/{ids['tiny-a']}").json()["autoStartNote"] or ""
    assert "idleUnloadSeconds 10" in note, note
