"""vLLM's /metrics read into the telemetry KPIs, against vLLM's own metric names.

The fixtures (tests/agent/fixtures/vllm_metrics*.txt) are vLLM's metric families as
prometheus_client prints them; each file's header says which vLLM version and module
the names are from and how it was made.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_telemetry import KEY, engine

from agent.telemetry._engines import (
    METRIC_NAMES,
    MetricsError,
    engine_metrics,
    parse_prometheus,
    scrape,
)

__all__ = ["engine"]  # the stand-in engine fixture of test_telemetry, used here

pytestmark = pytest.mark.timeout(60)

FIXTURES = Path(__file__).parent / "fixtures"
# vLLM 0.8 (V1): vllm:gpu_cache_usage_perc and vllm:gpu_prefix_cache_{queries,hits}.
OLD_NAMES = (FIXTURES / "vllm_metrics.txt").read_text()
# vLLM 0.12 (V1): vllm:kv_cache_usage_perc and vllm:prefix_cache_{queries,hits}.
NEW_NAMES = (FIXTURES / "vllm_metrics_kv_cache.txt").read_text()
# The new names with two engine cores, engine="0" and engine="1".
TWO_ENGINES = (FIXTURES / "vllm_metrics_two_engines.txt").read_text()

# One engine core: 2 running, 3 waiting, the KV cache 42 % full, 4096 of 16384 prompt
# tokens found in the prefix cache (the 0.8 counters count blocks of 16: 256 of 1024),
# and 10 first tokens that took 6.371 s together.
ONE_ENGINE_KPIS = {
    "requestsRunning": 2.0,
    "requestsWaiting": 3.0,
    "promptTokensTotal": 15231.0,
    "generationTokensTotal": 48210.0,
    "kvCacheUsageRatio": 0.42,
    "prefixCacheHitRate": 0.25,
    "timeToFirstTokenSecondsSum": 6.371,
    "timeToFirstTokenCount": 10.0,
}


def kpis(text: str) -> dict[str, float]:
    return engine_metrics(parse_prometheus(text))


def vllm_lines(text: str) -> list[str]:
    """The fixture's vllm: samples (no comments, no other families)."""
    return [line for line in text.splitlines() if line.startswith("vllm:")]


def test_the_names_before_the_rename_give_every_kpi() -> None:
    assert kpis(OLD_NAMES) == ONE_ENGINE_KPIS


def test_the_names_after_the_rename_give_the_same_kpis() -> None:
    assert "vllm:gpu_cache_usage_perc{" not in NEW_NAMES
    assert kpis(NEW_NAMES) == ONE_ENGINE_KPIS


def test_both_names_at_once_count_once() -> None:
    """vLLM 0.9 to 0.11 print the old names beside the new ones, with the same values."""
    both = NEW_NAMES + "\n".join(
        line
        for line in vllm_lines(OLD_NAMES)
        if line.startswith(("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_"))
    )
    assert "vllm:gpu_cache_usage_perc{" in both and "vllm:kv_cache_usage_perc{" in both
    assert kpis(both) == ONE_ENGINE_KPIS
    # Were the two ever to differ, the current name is the one read.
    drifted = both.replace(
        'vllm:gpu_cache_usage_perc{engine="0",model_name="qwen2.5-7b-instruct"} 0.42',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="qwen2.5-7b-instruct"} 0.99',
    )
    assert drifted != both and kpis(drifted)["kvCacheUsageRatio"] == 0.42


def test_two_engine_cores_are_added_and_their_ratios_averaged() -> None:
    found = kpis(TWO_ENGINES)
    assert found == {
        "requestsRunning": 3.0,  # 2 + 1
        "requestsWaiting": 3.0,  # 3 + 0
        "promptTokensTotal": 19252.0,  # 15231 + 4021
        "generationTokensTotal": 58115.0,  # 48210 + 9905
        "kvCacheUsageRatio": 0.3,  # (0.42 + 0.18) / 2, never 0.6
        "prefixCacheHitRate": 0.25,  # (4096 + 1000) / (16384 + 4000)
        "timeToFirstTokenSecondsSum": 7.035,  # 6.371 + 0.664
        "timeToFirstTokenCount": 13.0,  # 10 + 3
    }
    # The pooled mean over both cores, as the master would take it over one interval.
    mean = found["timeToFirstTokenSecondsSum"] / found["timeToFirstTokenCount"]
    assert mean == 7.035 / 13


def test_labels_do_not_confuse_the_parse() -> None:
    """Label values with braces, commas, quotes, spaces and '#' are one value each."""
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="a} 7, b=\\"x\\" #c"} 4.0',
            'vllm:num_requests_running{model_name="a",engine="1",} 1.0',
            "vllm:num_requests_running 2.0",  # no labels at all
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0 1700000000000',
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 9.0',
        ]
    )
    assert kpis(text) == {"requestsRunning": 7.0, "requestsWaiting": 0.0}


def test_families_that_are_not_kpis_are_ignored() -> None:
    unknown = "\n".join(
        line
        for line in OLD_NAMES.splitlines()
        if not line.startswith(tuple(METRIC_NAMES))
        and not line.startswith(("vllm:gpu_prefix_cache_", "vllm:prefix_cache_"))
    )
    # Only histograms, other counters, _created series, info gauges and the Python
    # process: nothing of it is a KPI, and none of it is made up as 0.
    assert "vllm:time_to_first_token_seconds_bucket{" in unknown
    assert "vllm:prompt_tokens_created{" in unknown
    assert kpis(unknown) == {}


def test_absent_kpis_stay_absent() -> None:
    # vllm serve --disable-log-stats registers no vllm: family at all.
    bare = "\n".join(line for line in NEW_NAMES.splitlines() if not line.startswith("vllm:"))
    assert "process_resident_memory_bytes" in bare
    assert kpis(bare) == {}
    # A server that has served nothing yet: the histogram counts 0, the prefix cache has
    # had no query, so there is no hit rate rather than a made-up one.
    fresh = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 0.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0',
            'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 0.0',
            'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.0',
        ]
    )
    assert kpis(fresh) == {
        "requestsRunning": 0.0,
        "timeToFirstTokenSecondsSum": 0.0,
        "timeToFirstTokenCount": 0.0,
    }
    # A NaN is not a value (JSON has none); the other engine's value stands alone.
    nan = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} +Inf\n'
    )
    assert kpis(nan) == {"kvCacheUsageRatio": 0.5}
    # Numbers whose sum or ratio leaves the floats are no value either (not a crash of
    # the sampler).
    huge = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.7e308\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.7e308\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1e308\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1e-300\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
    )
    assert kpis(huge) == {"requestsWaiting": 1.0}


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda t: t[: t.index('model_name="qwen') + 8], id="cut-in-a-label"),
        pytest.param(lambda t: t.replace("} 3.0\n", "} three\n", 1), id="word-for-a-number"),
        pytest.param(lambda t: t.replace("} 2.0\n", "}\n", 1), id="no-value"),
        pytest.param(lambda t: t.replace('engine="0"', "engine=0", 1), id="unquoted-label"),
        pytest.param(lambda t: "<html><body>Internal Server Error</body></html>\n", id="html"),
    ],
)
def test_a_malformed_exposition_is_a_metrics_error(spoil: Any) -> None:
    body = spoil(NEW_NAMES)
    with pytest.raises(MetricsError, match=r"line \d+ of /metrics"):
        kpis(body)


# -- over HTTP, with the instance's key -----------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [(OLD_NAMES, ONE_ENGINE_KPIS), (NEW_NAMES, ONE_ENGINE_KPIS)],
    ids=["before-rename", "after-rename"],
)
async def test_scrape_reads_vllm_with_the_instance_key(
    engine: Any, fixture: str, expected: dict[str, float]
) -> None:
    port = engine(fixture)
    async with aiohttp.ClientSession() as session:
        assert await scrape(session, port, KEY) == expected
        with pytest.raises(MetricsError, match="answered 401") as refused:
            await scrape(session, port, "another-instance-key")
        assert KEY not in str(refused.value)


async def test_scrape_of_two_engines_and_of_garbage(engine: Any) -> None:
    async with aiohttp.ClientSession() as session:
        found = await scrape(session, engine(TWO_ENGINES), KEY)
        assert found["requestsRunning"] == 3.0 and found["timeToFirstTokenCount"] == 13.0
        # A body cut off mid-line (an engine that died while answering).
        cut = NEW_NAMES[: NEW_NAMES.index("vllm:generation_tokens_total{") + 30]
        with pytest.raises(MetricsError, match="is not Prometheus text"):
            await scrape(session, engine(cut), KEY)
        with pytest.raises(MetricsError, match="not UTF-8"):
            await scrape(session, engine(b"\x1f\x8b\x08\x00 gzip bytes"), KEY)


def test_the_fixtures_are_what_the_tests_say() -> None:
    """Guards the hand-set values the expected dicts rely on."""
    for text in (OLD_NAMES, NEW_NAMES, TWO_ENGINES):
        samples = parse_prometheus(text)
        assert samples["vllm:num_requests_running"][0] == 2.0
        assert samples["vllm:num_requests_waiting"][0] == 3.0
        assert all(math.isfinite(v) for values in samples.values() for v in values)
        # prometheus_client's counters: _total beside _created, histograms with buckets.
        assert "vllm:prompt_tokens_created" in samples
        assert len(samples["vllm:time_to_first_token_seconds_bucket"]) >= 23
