"""The fair queue across two real web processes in front of a real llama-server.

The model has two slots (``parallel: 2``). Two long streams take both slots (with
``ignore_eos`` they cannot end early); once llama-server says both are busy, ten
more requests arrive, half through each web process. Every one is answered, each
of the ten waited and says so in ``x-mirbad-queue-ms``, and llama-server itself
never holds more than its two slots (its own /metrics: requests processing at most
2, none deferred), which is what the queue is for. Nothing here depends on how
fast the requests arrive: the ten are sent only after the slots are seen full.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.conftest import create_and_start, llama_server_or_fail, wait_for

pytestmark = pytest.mark.slow


def _engine(data: Path) -> tuple[int, str]:
    """The port of the llama-server the stack's agent started, and its API key."""
    for proc in psutil.process_iter(["cmdline", "environ"]):
        cmd = proc.info["cmdline"] or []
        if cmd and cmd[0].endswith("llama-server") and any(str(data) in c for c in cmd):
            return int(cmd[cmd.index("--port") + 1]), (proc.info["environ"] or {})["LLAMA_API_KEY"]
    raise AssertionError("no llama-server process for this stack")


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^llamacpp:{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"llama-server's /metrics has no {name}"
    return float(match.group(1))


def test_two_web_processes_never_send_the_engine_more_than_its_slots(
    make_stack, tmp_path: Path
) -> None:
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
            "settings": {"context_size": 8192, "gpu_layers": 0, "parallel": 2},
            "node": "local",
        },
    )
    keys = [
        api.post("/api/keys", json={"name": f"k{i}", "scopes": ["chat"]}).json()["key"]
        for i in range(2)
    ]
    engine_port, engine_key = _engine(stack.data)
    engine = f"http://127.0.0.1:{engine_port}"

    with stack.second_web_process() as second:
        urls = [stack.url, second]

        most = {"processing": 0.0, "deferred": 0.0}
        sampling = True
        sampler_errors: list[BaseException] = []

        def sample() -> None:
            try:
                _sample()
            except BaseException as exc:
                sampler_errors.append(exc)

        def _sample() -> None:
            headers = {"Authorization": f"Bearer {engine_key}"}
            with httpx.Client(timeout=5, headers=headers) as client:
                while sampling:
                    text = client.get(f"{engine}/metrics").text
                    most["processing"] = max(most["processing"],
                                             _gauge(text, "requests_processing"))  # fmt: skip
                    most["deferred"] = max(most["deferred"], _gauge(text, "requests_deferred"))
                    time.sleep(0.005)

        results: dict[int, tuple[int, float | None, bool]] = {}
        # The long ones: 3,000 tokens each (4,096 a slot), a second or more of work
        # even at the tiny model's full speed, while the ten short ones need
        # milliseconds to arrive.
        long_ones = (0, 1)

        def one(i: int) -> None:
            body = {"model": "tiny", "stream": True,
                    "messages": [{"role": "user", "content": f"count {i}"}]}  # fmt: skip
            body |= (
                {"max_tokens": 3000, "ignore_eos": True} if i in long_ones else {"max_tokens": 24}
            )
            with (
                httpx.Client(timeout=120) as client,
                client.stream(
                    "POST",
                    f"{urls[i % 2]}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {keys[i % 2]}"},
                    json=body,
                ) as response,
            ):
                whole = b"".join(response.iter_bytes())
                queued = response.headers.get("x-mirbad-queue-ms")
                # The tiny model may stop a short one early: a whole stream ends in [DONE].
                results[i] = (
                    response.status_code,
                    float(queued) if queued else None,
                    b"[DONE]" in whole,
                )

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        clients = [threading.Thread(target=one, args=(i,)) for i in long_ones]
        for thread in clients:
            thread.start()
        wait_for(lambda: most["processing"] == 2 or sampler_errors, 60, "both slots busy")
        assert not results, f"a long stream ended before the slots were seen full: {results}"
        later = [threading.Thread(target=one, args=(i,)) for i in range(2, 12)]
        for thread in later:
            thread.start()
        for thread in clients + later:
            thread.join(timeout=180)
        sampling = False
        sampler.join(timeout=10)

        assert sorted(results) == list(range(12)), results
        assert all(status == 200 for status, _, _ in results.values()), results
        assert all(done for _, _, done in results.values()), results
        assert all(results[i][1] is not None for i in results), "every answer says its wait"
        waits = sorted(results[i][1] or 0.0 for i in range(2, 12))
        # Both slots were busy when each of the ten arrived: every one of them waited.
        assert all(w > 1.0 for w in waits), waits
        print(f"queue waits (ms): {waits}; engine at most {most}")
        assert not sampler_errors, sampler_errors
        # Both slots were seen busy (the sampling works), never a third, nothing deferred.
        assert most["processing"] == 2, most
        assert most["deferred"] == 0, most

        metrics = api.get("/metrics").text
        assert "mirbad_v1_queue_wait_seconds_count" in metrics
