"""Routes end to end: a real stack, two llama-server models, a second web process.

* Repointing: PATCH /api/routes/{name} and both web processes send the route's
  requests to the new first target within a second (the announcement, not the TTL).
* Fallback: the route's first model stopped, its requests are still answered, by the
  second, and /metrics and /api/usage name the served name that answered.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import create_and_start, llama_server_or_fail, wait_for

pytestmark = pytest.mark.slow


def _model(name: str) -> dict:
    return {
        "servedName": name,
        "sourceFolder": "tiny",
        "sourceFile": "tiny.gguf",
        "settings": {"context_size": 256, "gpu_layers": 0},
        "node": "local",
    }


def _ask(url: str, key: str, model: str = "assistant") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        timeout=30,
    )


def _answered_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["model"])  # the served name the router sent upstream


def test_a_route_is_repointed_everywhere_and_falls_back(make_stack, tmp_path: Path) -> None:
    llama_server_or_fail()
    stack = make_stack(embedded=False)
    stack.prepare_local_model()
    facts = stack.start()
    admin = facts["API key"]
    api = stack.api(admin, timeout=60)
    first = create_and_start(api, _model("tiny-a"))
    create_and_start(api, _model("tiny-b"))
    created = api.post("/api/routes", json={"name": "assistant", "targets": ["tiny-a", "tiny-b"]})
    assert created.status_code == 201, created.text
    key = api.post("/api/keys", json={"name": "app", "scopes": ["chat"]}).json()["key"]

    with stack.second_web_process() as second:
        urls = [stack.url, second]
        # Both processes have the route cached (the TTL alone would keep it 10 s).
        for url in urls:
            assert _answered_by(_ask(url, key)) == "tiny-a"
            listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert {"tiny-a", "tiny-b", "assistant"} <= {m["id"] for m in listed.json()["data"]}

        # -- repointed: both processes follow within a second ----------------------------
        changed = api.patch("/api/routes/assistant", json={"targets": ["tiny-b", "tiny-a"]})
        assert changed.status_code == 200, changed.text
        patched_at = time.monotonic()
        for url in urls:
            while True:
                sent_at = time.monotonic()
                if _answered_by(_ask(url, key)) == "tiny-b":
                    break
                assert sent_at - patched_at < 1.0, f"{url} still routed to tiny-a after 1 s"
                time.sleep(0.02)
            assert sent_at - patched_at < 1.0, (
                f"{url} followed only after {sent_at - patched_at:.2f} s"
            )

        # -- fallback: the first target stopped, the second answers -----------------------
        back = api.patch("/api/routes/assistant", json={"targets": ["tiny-a", "tiny-b"]})
        assert back.status_code == 200
        wait_for(lambda: _answered_by(_ask(stack.url, key)) == "tiny-a", 5, "tiny-a first again")
        assert api.post(f"/api/models/{first}/stop").status_code == 200
        answered = [_answered_by(_ask(stack.url, key)) for _ in range(6)]
        assert answered == ["tiny-b"] * 6, answered
        # The model itself is refused: the route is what kept the application answered.
        assert _ask(stack.url, key, "tiny-a").status_code == 503

        scrape = httpx.get(f"{stack.url}/metrics", headers={"Authorization": f"Bearer {admin}"})
        fallbacks = [
            line
            for line in scrape.text.splitlines()
            if line.startswith("mirbad_v1_route_fallbacks_total{")
            and 'route="assistant"' in line
            and 'served="tiny-b"' in line
        ]
        assert fallbacks and float(fallbacks[0].rsplit(" ", 1)[1]) >= 6, scrape.text[-3000:]

        def metered() -> dict | None:
            rows = api.get("/api/usage").json()["usage"]
            b_rows = [r for r in rows if r["keyPrefix"] == key[:10] and r["model"] == "tiny-b"]
            return b_rows[0] if b_rows and b_rows[0]["requests"] >= 7 else None

        row = wait_for(metered, 15, "the usage flush")  # 6 fallbacks + 1 repointed request
        assert row["completionTokens"] >= 7
        usage_models = {r["model"] for r in api.get("/api/usage").json()["usage"]}
        assert "assistant" not in usage_models  # metered by the served name, never the alias
