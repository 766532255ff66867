"""The 5-second telemetry sampler: engine /metrics, process groups, GPUs, the endpoint
(docs/decisions.md D61)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_support import launch_body
from aiohttp import web
from test_end_to_end import launch_ready, llama_entry, start_agent, wait_ready

from agent._config import AgentConfig, ExecutableEntry
from agent.telemetry._describe import parse_gpus
from agent.telemetry._engines import (
    EngineTarget,
    GroupMeter,
    MetricsError,
    engine_metrics,
    parse_prometheus,
    scrape,
)
from agent.telemetry._host import Telemetry

pytestmark = pytest.mark.timeout(60)

# What the llama-server ./mirbad test builds (PyPI llama-cpp 11434.0.0, --metrics) answered
# on /metrics after one chat completion: it reports no KV cache gauges any more.
LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 56
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 8
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.007023
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 8
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 0.00086
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 8
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 63
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 0
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 7973.8
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 8139.53
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1
"""

# An older llama-server that still reported its KV cache.
LLAMACPP_OLD_METRICS = """\
llamacpp:prompt_tokens_total 6886
llamacpp:tokens_predicted_total 3469
llamacpp:kv_cache_usage_ratio 0.25
llamacpp:kv_cache_tokens 512
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
"""

# vLLM V1 (two engines of one server: label sets are added, ratios averaged).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 2.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="qwen"} 1.7e+09
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen"} 250.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="qwen"} 12345.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="qwen"} 678.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="qwen"} 4.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="qwen"} 1.5
"""

# vLLM V0 names: gpu_cache_usage_perc and a ready-made prefix cache hit rate.
VLLM_V0_METRICS = """\
vllm:num_requests_running{model_name="m"} 1.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.125
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.75
vllm:gpu_prefix_cache_hit_rate{model_name="m",extra="NaN"} NaN
"""

# nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits on two H100s, one a
# MIG parent that reports no utilization.
NVIDIA_SMI = """\
0, GPU-5f3c1a2e-0000-1111-2222-333344445555, NVIDIA H100 80GB HBM3, 81559, 1024, 550.54.15, 37
1, GPU-aa3c1a2e-0000-1111-2222-333344445555, NVIDIA H100 80GB HBM3, 81559, 0, 550.54.15, [N/A]
"""


def test_llamacpp_metrics_map_onto_the_contract_and_absent_stays_absent() -> None:
    assert engine_metrics(parse_prometheus(LLAMACPP_METRICS)) == {
        "requestsRunning": 0.0,
        "requestsWaiting": 0.0,
        "promptTokensTotal": 56.0,
        "generationTokensTotal": 8.0,
        "prefixCacheHitRate": 8 / 64,  # cached / (cached + processed)
    }
    # Before the first prompt there is no hit rate to report (not a made-up 0).
    fresh = "llamacpp:prompt_tokens_total 0\nllamacpp:prompt_tokens_cached_total 0\n"
    assert engine_metrics(parse_prometheus(fresh)) == {"promptTokensTotal": 0.0}
    assert engine_metrics(parse_prometheus(LLAMACPP_OLD_METRICS)) == {
        "requestsRunning": 2.0,
        "requestsWaiting": 1.0,
        "promptTokensTotal": 6886.0,
        "generationTokensTotal": 3469.0,
        "kvCacheUsageRatio": 0.25,
        "kvCacheTokens": 512.0,
    }
    only = engine_metrics(parse_prometheus("llamacpp:requests_processing 4\n"))
    assert only == {"requestsRunning": 4.0}
    assert engine_metrics(parse_prometheus("")) == {}


def test_vllm_metrics_share_the_table() -> None:
    assert engine_metrics(parse_prometheus(VLLM_METRICS)) == {
        "requestsRunning": 4.0,
        "requestsWaiting": 2.0,
        "promptTokensTotal": 12345.0,
        "generationTokensTotal": 678.0,
        "kvCacheUsageRatio": 0.375,
        "prefixCacheHitRate": 0.25,
    }
    # A NaN is not a value: the other label set's 0.75 stands alone.
    assert engine_metrics(parse_prometheus(VLLM_V0_METRICS)) == {
        "requestsRunning": 1.0,
        "kvCacheUsageRatio": 0.125,
        "prefixCacheHitRate": 0.75,
    }


@pytest.mark.parametrize(
    "body",
    [
        "<html>Not Found</html>\n",
        "llamacpp:requests_processing\n",
        "llamacpp:requests_processing twelve\n",
        'llamacpp:requests_processing{slot="0 1\n',
        "llamacpp:requests_processing 1 2 3\n",
    ],
)
def test_garbage_is_refused_by_the_parser(body: str) -> None:
    with pytest.raises(MetricsError, match="line 1 of /metrics"):
        parse_prometheus(body)


def test_nvidia_smi_output_gives_utilization_when_it_is_reported() -> None:
    first, second = parse_gpus(NVIDIA_SMI)
    assert first == {
        "index": 0,
        "uuid": "GPU-5f3c1a2e-0000-1111-2222-333344445555",
        "name": "NVIDIA H100 80GB HBM3",
        "memoryTotalBytes": 81559 * 2**20,
        "memoryUsedBytes": 1024 * 2**20,
        "driverVersion": "550.54.15",
        "utilizationPercent": 37.0,
    }
    assert second["index"] == 1 and "utilizationPercent" not in second
    # The six-column answer of an older query still parses (no utilization at all).
    [old] = parse_gpus("0, GPU-x, T4, 15360, 0, 535.1\n")
    assert old["memoryTotalBytes"] == 15360 * 2**20 and "utilizationPercent" not in old


# -- scraping a stand-in engine over HTTP --------------------------------------------------


KEY = "instance-key-123"


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[str | bytes, int], Any]]:
    """A stand-in engine on a loopback port whose /metrics answers what a test sets."""
    state: dict[str, Any] = {"body": b"", "status": 200, "delay": 0.0}

    async def metrics(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "Invalid API Key"}}, status=401)
        await asyncio.sleep(state["delay"])
        return web.Response(body=state["body"], status=state["status"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def configure(body: str | bytes, status: int = 200, delay: float = 0.0) -> int:
        state.update(
            body=body.encode() if isinstance(body, str) else body, status=status, delay=delay
        )
        return port

    try:
        yield configure
    finally:
        await runner.cleanup()


async def test_scrape_reads_metrics_with_the_instance_key(engine: Any) -> None:
    port = engine(LLAMACPP_METRICS)
    async with aiohttp.ClientSession() as session:
        found = await scrape(session, port, KEY)
        assert found["promptTokensTotal"] == 56.0 and "kvCacheTokens" not in found
        with pytest.raises(MetricsError, match="answered 401") as refused:
            await scrape(session, port, "wrong-key")
        assert KEY not in str(refused.value)


async def test_oversize_slow_and_garbage_bodies_are_metrics_errors(engine: Any) -> None:
    async with aiohttp.ClientSession() as session:
        port = engine("llamacpp:requests_processing 1\n" * 50_000)  # about 1.6 MB
        with pytest.raises(MetricsError, match="larger than 1048576 bytes"):
            await scrape(session, port, KEY)
        port = engine("a" * 200, 200)
        with pytest.raises(MetricsError, match="larger than 100 bytes"):
            await scrape(session, port, KEY, max_bytes=100)
        port = engine(b"\xff\xfe binary")
        with pytest.raises(MetricsError, match="not UTF-8"):
            await scrape(session, port, KEY)
        port = engine("This server does not support metrics endpoint.", 501)
        with pytest.raises(MetricsError, match="answered 501: This server does not"):
            await scrape(session, port, KEY)
        port = engine(LLAMACPP_METRICS, delay=1.0)
        with pytest.raises(MetricsError, match=r"did not answer within 0\.2 s"):
            await scrape(session, port, KEY, time_limit=0.2)


async def test_sampler_runs_on_its_interval_and_keeps_the_latest(
    engine: Any, tmp_path: Path
) -> None:
    port = engine(LLAMACPP_METRICS)
    targets = [
        EngineTarget(instance_id="a", state="Ready", pid=0, port=port, key=KEY, ready=True),
        EngineTarget(instance_id="b", state="Ready", pid=0, port=port, key="bad", ready=True),
        EngineTarget(instance_id="c", state="Starting", pid=0, port=None, key=KEY, ready=False),
    ]
    telemetry = Telemetry(
        models_root=tmp_path, state_directory=tmp_path, engines=lambda: targets, interval=0.1
    )
    try:
        first = await telemetry.current()  # none yet: taken at once
        assert await telemetry.current() is first  # not started: the same sample
        telemetry.start()
        times = {first["time"]}
        for _ in range(50):
            await asyncio.sleep(0.05)
            times.add((await telemetry.current())["time"])
            if len(times) >= 3:
                break
        assert len(times) >= 3, "the sampler did not take new samples on its interval"
    finally:
        await telemetry.stop()
    sample = await telemetry.current()
    assert len(sample["cpuPerCore"]) == sample["cpuCount"] and sample["gpus"] == []
    a, b, c = sample["engines"]
    assert a["metrics"]["promptTokensTotal"] == 56.0 and "metricsError" not in a
    assert "metrics" not in b and "answered 401" in b["metricsError"]
    assert "metrics" not in c and c["metricsError"] == "not scraped: the instance is Starting"


def test_group_meter_sums_cpu_and_rss_over_the_whole_group() -> None:
    # A leader in its own session whose child spins one core, and a grandchild that sleeps.
    script = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "subprocess.Popen(['sleep', '60'])\n"
        "time.sleep(60)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        meter = GroupMeter()
        import time

        time.sleep(0.5)
        first = meter.measure([leader.pid])[leader.pid]
        assert first["cpuPercent"] == 0.0  # a new process only sets its baseline
        time.sleep(1.0)
        second = meter.measure([leader.pid])[leader.pid]
        assert second["cpuPercent"] > 50.0, second
        assert second["rssBytes"] > first["rssBytes"] / 2 > 0
        assert meter.measure([999_999_999]) == {999_999_999: {"cpuPercent": 0.0, "rssBytes": 0}}
    finally:
        import os
        import signal

        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


# -- the endpoint ------------------------------------------------------------------------


async def test_the_endpoint_serves_the_sampler_with_each_engine(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
) -> None:
    agent = await start_agent(pki, state_dir, tmp_path, make_config(executables=(fake_engine,)))
    try:
        inst = await launch_ready(agent, "m-1")
        await agent.server.telemetry.collect()  # not wait 5 s for the next tick
        async with agent.session.get(agent.url("/agent/v1/telemetry")) as resp:
            assert resp.status == 200
            sample = await resp.json()
        assert {"time", "cpuPercent", "cpuPerCore", "cpuCount", "load", "memory", "disks",
                "gpus", "engines"} <= set(sample)  # fmt: skip
        [eng] = sample["engines"]
        assert eng["instanceId"] == "m-1" and eng["pid"] == inst["pid"]
        assert eng["rssBytes"] > 1024 * 1024 and eng["cpuPercent"] >= 0.0
        # The fake engine has no /metrics: the KPIs are absent and the reason is given.
        assert "metrics" not in eng and "answered 404" in eng["metricsError"]
        # /status carries the same latest sample.
        async with agent.session.get(agent.url("/agent/v1/status")) as resp:
            status = await resp.json()
        assert status["telemetry"]["time"] == sample["time"]
    finally:
        await agent.session.close()
        await agent.server.stop()


@pytest.mark.slow
async def test_real_llama_server_prompt_tokens_rise_after_a_completion(
    pki: Any,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    llama_server_exe: Path,
    models_root: Path,
) -> None:
    """A tiny GGUF on the real llama-server: its /metrics read with the instance's key."""
    exe = llama_entry(llama_server_exe, models_root)
    agent = await start_agent(pki, state_dir, tmp_path, make_config(executables=(exe,)))
    try:
        args = [
            "-m", "{model}", "--alias", "tiny", "-c", "1024", "-np", "1", "-ngl", "0",
            "--host", "127.0.0.1", "--port", "{port}", "--metrics", "--no-ui",
            "--cache-ram", "0", "--fit", "off",
        ]  # fmt: skip
        body = launch_body(
            "tiny-1", servedName="tiny", model={"folder": "tiny", "file": "tiny.gguf"}, args=args
        )
        async with agent.session.post(agent.url("/agent/v1/instances"), json=body) as resp:
            assert resp.status == 202, await resp.text()
        await wait_ready(agent, "tiny-1", timeout=60)

        async def engine_sample() -> dict[str, Any]:
            await agent.server.telemetry.collect()
            async with agent.session.get(agent.url("/agent/v1/telemetry")) as resp:
                [eng] = (await resp.json())["engines"]
            return dict(eng)

        before = await engine_sample()
        assert "metricsError" not in before, before
        assert before["rssBytes"] > 0 and before["state"] == "Ready"
        metrics = before["metrics"]
        assert metrics["promptTokensTotal"] == 0.0 and metrics["requestsRunning"] == 0.0
        # This build reports no KV cache gauges: absent, not zero.
        assert "kvCacheUsageRatio" not in metrics and "kvCacheTokens" not in metrics
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        url = agent.url("/agent/v1/proxy/tiny-1/v1/chat/completions")
        async with agent.session.post(url, json=chat) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
        after = (await engine_sample())["metrics"]
        assert after["promptTokensTotal"] > metrics["promptTokensTotal"]
        assert after["generationTokensTotal"] == usage["completion_tokens"]
    finally:
        await agent.session.close()
        await agent.server.stop()
