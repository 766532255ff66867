"""Two real web processes share one key's limits: 6 RPM means 6 in total, not 12."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import create_and_start, llama_server_or_fail

pytestmark = pytest.mark.slow


def test_rpm_holds_across_two_router_processes(make_stack, tmp_path: Path) -> None:
    llama_server_or_fail()
    stack = make_stack(embedded=False)
    stack.prepare_local_model()
    facts = stack.start()
    api = stack.api(facts["API key"], timeout=60)
    create_and_start(
        api,
        {
            "servedName": "tiny",
            "sourceFolder": "tiny",
            "sourceFile": "tiny.gguf",
            "settings": {"context_size": 256, "gpu_layers": 0},
            "node": "local",
        },
    )
    key = api.post("/api/keys", json={"name": "six", "scopes": ["chat"], "rpmLimit": 6}).json()

    # A second web process of the same master: same data, database and Redis.
    with stack.second_web_process() as second:
        urls = [stack.url, second]
        # Limits count calendar minutes: start early in one, so all 20 land in it.
        while time.time() % 60 > 40:
            time.sleep(0.5)
        codes: list[int] = []
        for i in range(20):
            response = httpx.post(
                f"{urls[i % 2]}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key['key']}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                      "max_tokens": 1},
                timeout=30,
            )  # fmt: skip
            codes.append(response.status_code)
            if response.status_code == 429:
                assert 1 <= int(response.headers["retry-after"]) <= 60
        assert codes.count(200) == 6, codes
        assert codes.count(429) == 14, codes
        # Both processes answered some of the six, so neither counted alone.
        assert 200 in codes[0::2] and 200 in codes[1::2], codes
