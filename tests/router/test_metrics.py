"""router.metrics: the rendered exposition, parsed back, holds the values observed."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from router import metrics
from router.metrics import OVERHEAD_BUCKETS, Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _get(m: Metrics, name: str, **labels: str) -> float | None:
    return _samples(m).get((name, tuple(sorted(labels.items()))))


def test_requests_errors_and_times() -> None:
    m = Metrics()
    m.observe_request("qwen", "mbd_ab12", 200, 1.5, ttfb=0.2, overhead=0.0009)
    m.observe_request("qwen", "mbd_ab12", 200, 0.02, ttfb=0.01, overhead=0.0012)
    m.observe_request("qwen", "mbd_ab12", 503, 0.001, overhead=0.0004, error_code="model_not_ready")
    m.observe_request("unknown", "mbd_ab12", 404, 0.001, error_code="model_not_found")
    m.observe_request("qwen", "none", 400, 0.3, ttfb=0.3)  # the engine's 400: code is the status
    m.observe_request("qwen", "mbd_ab12", 200, 2.0, ttfb=0.1, error_code="stream_error")

    key = {"key_prefix": "mbd_ab12"}
    assert _get(m, "mirbad_v1_requests_total", model="qwen", code="200", **key) == 3
    assert _get(m, "mirbad_v1_requests_total", model="qwen", code="503", **key) == 1
    assert _get(m, "mirbad_v1_requests_total", model="unknown", code="404", **key) == 1
    assert _get(m, "mirbad_v1_requests_total", model="qwen", code="400", key_prefix="none") == 1
    assert _get(m, "mirbad_v1_errors_total", model="qwen", code="model_not_ready", **key) == 1
    assert _get(m, "mirbad_v1_errors_total", model="unknown", code="model_not_found", **key) == 1
    assert _get(m, "mirbad_v1_errors_total", model="qwen", code="400", key_prefix="none") == 1
    assert _get(m, "mirbad_v1_errors_total", model="qwen", code="stream_error", **key) == 1
    assert _get(m, "mirbad_v1_errors_total", model="qwen", code="200", **key) is None

    assert _get(m, "mirbad_v1_request_seconds_count", model="qwen") == 5
    assert _get(m, "mirbad_v1_request_seconds_sum", model="qwen") == pytest.approx(3.821)
    assert _get(m, "mirbad_v1_request_seconds_bucket", model="qwen", le="0.025") == 2
    assert _get(m, "mirbad_v1_request_seconds_bucket", model="qwen", le="600.0") == 5
    assert _get(m, "mirbad_v1_request_seconds_bucket", model="qwen", le="+Inf") == 5
    assert _get(m, "mirbad_v1_ttfb_seconds_count", model="qwen") == 4
    assert _get(m, "mirbad_v1_ttfb_seconds_bucket", model="qwen", le="0.01") == 1
    assert _get(m, "mirbad_v1_ttfb_seconds_count", model="unknown") is None

    assert _get(m, "mirbad_v1_router_overhead_seconds_count") == 3
    assert _get(m, "mirbad_v1_router_overhead_seconds_bucket", le="0.0001") == 0
    assert _get(m, "mirbad_v1_router_overhead_seconds_bucket", le="0.0005") == 1
    assert _get(m, "mirbad_v1_router_overhead_seconds_bucket", le="0.0013") == 3  # the target


def test_overhead_buckets_start_at_a_tenth_of_a_millisecond() -> None:
    assert OVERHEAD_BUCKETS[0] == 0.0001 and 0.0013 in OVERHEAD_BUCKETS


def test_tokens() -> None:
    m = Metrics()
    m.add_tokens("qwen", "mbd_ab12", 67, 8)
    m.add_tokens("qwen", "mbd_ab12", 3, 2)
    m.add_tokens("embed", "mbd_ab12", 44, 0)
    labels = {"model": "qwen", "key_prefix": "mbd_ab12"}
    assert _get(m, "mirbad_v1_tokens_total", kind="prompt", **labels) == 70
    assert _get(m, "mirbad_v1_tokens_total", kind="completion", **labels) == 10
    assert (
        _get(m, "mirbad_v1_tokens_total", model="embed", key_prefix="mbd_ab12", kind="prompt") == 44
    )
    assert (
        _get(m, "mirbad_v1_tokens_total", model="embed", key_prefix="mbd_ab12", kind="completion")
        is None
    )


def test_in_flight() -> None:
    m = Metrics()
    with m.in_flight("qwen"):
        with m.in_flight("qwen"):
            assert _get(m, "mirbad_v1_in_flight", model="qwen") == 2
        m.inc_in_flight("embed")
        assert _get(m, "mirbad_v1_in_flight", model="qwen") == 1
    assert _get(m, "mirbad_v1_in_flight", model="qwen") == 0
    assert _get(m, "mirbad_v1_in_flight", model="embed") == 1
    m.dec_in_flight("embed")
    assert _get(m, "mirbad_v1_in_flight", model="embed") == 0
    with pytest.raises(RuntimeError), m.in_flight("qwen"):
        raise RuntimeError
    assert _get(m, "mirbad_v1_in_flight", model="qwen") == 0


def test_label_values_are_bounded() -> None:
    m = Metrics(max_label_values=2)
    for name in ("a", "b", "c", "d"):
        m.observe_request(name, f"k{name}", 200, 0.1)
    m.observe_request("a", "ka", 200, 0.1)
    m.observe_request("", "", 200, 0.1)  # empty labels read as unknown / none → "other" here
    samples = _samples(m)
    models = {
        dict(labels)["model"] for (name, labels) in samples if name == "mirbad_v1_requests_total"
    }
    assert models == {"a", "b", "other"}
    assert _get(m, "mirbad_v1_requests_total", model="a", key_prefix="ka", code="200") == 2
    assert _get(m, "mirbad_v1_requests_total", model="other", key_prefix="other", code="200") == 3


def test_registry_is_not_the_global_one() -> None:
    m = Metrics()
    assert m.registry is not REGISTRY
    assert REGISTRY.get_sample_value("mirbad_v1_requests_total") is None
    Metrics()  # a second instance registers its families again without a clash


def test_module_functions_use_the_process_instance() -> None:
    before = metrics.METRICS.registry.get_sample_value(
        "mirbad_v1_requests_total", {"model": "mod-test", "key_prefix": "none", "code": "200"}
    )
    metrics.observe_request("mod-test", "none", 200, 0.01)
    metrics.add_tokens("mod-test", "none", 1, 1)
    with metrics.in_flight("mod-test"):
        pass
    body, _ = metrics.render()
    assert b'mirbad_v1_requests_total{code="200",key_prefix="none",model="mod-test"}' in body
    after = metrics.METRICS.registry.get_sample_value(
        "mirbad_v1_requests_total", {"model": "mod-test", "key_prefix": "none", "code": "200"}
    )
    assert after == (before or 0) + 1
