"""The fair queue across two real web processes in front of a real llama-server.

The model has two slots (``parallel: 2``). Two long streams take both slots: with
``ignore_eos``, 6,000 tokens and a model file that declares a long context they
cannot end early (about 6 s of work each here, where the rest needs well under a
second). Once llama-server says both are busy, ten more requests arrive, half
through each web process; the test checks that the master's
``mirbad_router_queue_depth`` shows all ten waiting before either long stream has
ended. Every one of the ten is then answered, each waited and says so in
``x-mirbad-queue-ms``, and llama-server itself never holds more than its two slots
(its own /metrics: requests processing at most 2, none deferred), which is what the
queue is for. Each step waits on the event the next one needs.

The long streams end on their own rather than being hung up: a hang-up frees the
master's slot at once while llama-server notices the closed connection a moment
later, so the next request could be deferred there for that moment.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from protocol.tinygguf import write_tiny_gguf
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
    # A tiny model that declares a long context: llama-server ends an answer at the
    # file's training context whatever max_tokens says (512 tokens in the stock one).
    write_tiny_gguf(stack.data / "models" / "tiny" / "tiny.gguf", context=16384)
    facts = stack.start()
    api = stack.api(facts["API key"], timeout=60)
    create_and_start(
        api,
        {
            "servedName": "tiny",
            "sourceFolder": "tiny",
            "sourceFile": "tiny.gguf",
            "settings": {"context_size": 16384, "gpu_layers": 0, "parallel": 2},
            # The ten wait for as long as the long ones take on a loaded machine: what
            # is checked is the queue's order and bound, not the engine's speed.
            "queueTimeoutSeconds": 600,
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
        refusals: dict[int, str] = {}
        # The long ones: 6,000 tokens each (8,192 a slot). Attention makes each token
        # dearer as the answer grows: 8,000 tokens took 9.7 s alone on this machine.
        long_ones = (0, 1)

        def one(i: int) -> None:
            body = {"model": "tiny", "stream": True,
                    "messages": [{"role": "user", "content": f"count {i}"}]}  # fmt: skip
            body |= (
                {"max_tokens": 6000, "ignore_eos": True} if i in long_ones else {"max_tokens": 24}
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
                if response.status_code != 200:
                    refusals[i] = whole[:300].decode(errors="replace")

        def waiting() -> float:
            text = api.get("/metrics").text
            match = re.search(
                r'^mirbad_router_queue_depth\{model="tiny"\} ([0-9.e+-]+)$', text, re.MULTILINE
            )
            return float(match.group(1)) if match else -1.0

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        clients = [threading.Thread(target=one, args=(i,)) for i in long_ones]
        for thread in clients:
            thread.start()
        wait_for(lambda: most["processing"] == 2 or sampler_errors, 60, "both slots busy")
        assert not sampler_errors, sampler_errors
        assert not results, f"a long stream ended before the slots were seen full: {results}"
        later = [threading.Thread(target=one, args=(i,)) for i in range(2, 12)]
        for thread in later:
            thread.start()
        wait_for(lambda: waiting() == 10 or results, 60, "the ten waiting in the master's queue")
        assert not results, f"a long stream ended before the ten were seen waiting: {results}"
        for thread in clients + later:
            thread.join(timeout=180)
        sampling = False
        sampler.join(timeout=10)

        assert sorted(results) == list(range(12)), results
        assert all(status == 200 for status, _, _ in results.values()), (results, refusals)
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
