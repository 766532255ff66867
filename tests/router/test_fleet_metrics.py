"""/metrics carries the fleet: names, labels and values from recorded telemetry; who may read it."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from nodes import status_cache, telemetry
from router.app import RouterApp
from tests.factories import make_model, make_node, set_status
from tests.telemetry_support import GIB, engine, history, sample

__all__ = ["history"]  # the fixture, imported to be used

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("close_db_after", "status_redis", "history"),
]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
EXPIRES = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


@pytest.fixture
def client() -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=RouterApp(), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://router")


def _parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _names(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in samples if n == name]


def _fleet() -> dict[str, Any]:
    """n1 fresh, n2 last heard 2 minutes ago, n3 waiting for approval; model m on n1, n2."""
    n1 = make_node("n1", cert_not_after=EXPIRES)
    n2 = make_node("n2")
    make_node("n3", approved=False)
    model = make_model("qwen-7b", n1)
    model.placements.create(node=n2)
    make_model("idle-one")  # no placement: flags only
    a, b = (p.instance_id for p in model.placements.order_by("id"))
    ready = {"state": "Ready"}
    set_status(n1, instances={a: {"instanceId": a, **ready}})
    set_status(n2, instances={b: {"instanceId": b, **ready}})
    return {"a": a, "b": b}


async def _record(ids: dict[str, Any]) -> None:
    now = time.time()
    first = sample(
        engine(ids["a"], running=2, waiting=3, prompt=1000, gen=100, kv=0.42, prefix_hit=0.9),
        engine("stray-1", running=9),  # an engine the registry does not know
    )
    await telemetry.arecord("n1", first, now=now - 5)
    second = sample(
        engine(ids["a"], running=2, waiting=3, prompt=1500, gen=150, kv=0.42, prefix_hit=0.9),
        engine("stray-1", running=9),
    )
    second["disks"].append({"path": "bad path\n", "freeBytes": 1, "totalBytes": 2})
    await telemetry.arecord("n1", second, now=now)
    # The monitor keeps the last sample in the node's status record too (disks come from it).
    record = status_cache.read("n1")
    assert record is not None
    record["telemetry"] = second
    status_cache.write(record)
    await telemetry.arecord("n2", sample(engine(ids["b"], running=7)), now=now - 120)  # stale


async def _scrape(client: httpx.AsyncClient, key: str) -> Samples:
    response = await client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return _parse(response.text)


async def test_fleet_families_from_recorded_samples(
    client: httpx.AsyncClient, admin_key: str
) -> None:
    ids = await sync_to_async(_fleet)()
    await _record(ids)
    got = await _scrape(client, admin_key)

    # The router's own families are still there.
    assert _get(got, "mirbad_v1_router_overhead_seconds_count") is not None
    # Nodes: the fresh one has values; the stale one and the pending one have none.
    assert _get(got, "mirbad_node_cpu_percent", node="n1") == 12.5
    assert _names(got, "mirbad_node_cpu_percent") == [{"node": "n1"}]
    assert _get(got, "mirbad_node_memory_used_bytes", node="n1") == 6 * GIB
    assert _get(got, "mirbad_node_memory_total_bytes", node="n1") == 16 * GIB
    assert _get(got, "mirbad_node_load1", node="n1") == 0.5
    disk = {"node": "n1", "path": "/var/lib/mirbad"}
    assert _get(got, "mirbad_node_disk_free_bytes", **disk) == 40 * GIB
    assert _get(got, "mirbad_node_disk_total_bytes", **disk) == 100 * GIB
    assert _names(got, "mirbad_node_disk_free_bytes") == [disk]  # n2 stale; the bad path out
    gpu = {"node": "n1", "gpu": "0"}
    assert _get(got, "mirbad_node_gpu_memory_used_bytes", **gpu) == 20 * GIB
    assert _get(got, "mirbad_node_gpu_memory_total_bytes", **gpu) == 80 * GIB
    assert _get(got, "mirbad_node_gpu_utilization_percent", **gpu) == 55.0
    assert _names(got, "mirbad_node_gpu_utilization_percent") == [gpu]
    # States: one 1 per node, from the effective status.
    assert _get(got, "mirbad_node_state", node="n1", state="Online") == 1
    assert _get(got, "mirbad_node_state", node="n1", state="Offline") == 0
    assert _get(got, "mirbad_node_state", node="n2", state="Online") == 1  # status, not telemetry
    assert _get(got, "mirbad_node_state", node="n3", state="PendingApproval") == 1
    assert sum(v for (n, labels), v in got.items() if n == "mirbad_node_state") == 3
    assert _get(got, "mirbad_node_certificate_expiry_timestamp_seconds", node="n1") == (
        EXPIRES.timestamp()
    )
    assert _names(got, "mirbad_node_certificate_expiry_timestamp_seconds") == [{"node": "n1"}]
    # The model on n1; nothing of its stale replica on n2, nothing of the stray engine.
    on_n1 = {"model": "qwen-7b", "node": "n1"}
    assert _get(got, "mirbad_model_memory_bytes", **on_n1) == 3 * GIB
    assert _get(got, "mirbad_model_requests_running", **on_n1) == 2
    assert _get(got, "mirbad_model_requests_waiting", **on_n1) == 3
    assert _get(got, "mirbad_model_prompt_tokens_per_second", **on_n1) == pytest.approx(100, 0.01)
    assert _get(got, "mirbad_model_generation_tokens_per_second", **on_n1) == pytest.approx(
        10, 0.01
    )
    assert _get(got, "mirbad_model_kv_cache_usage_ratio", **on_n1) == 0.42
    assert _get(got, "mirbad_model_prefix_cache_hit_ratio", **on_n1) == 0.9
    for name in ("mirbad_model_memory_bytes", "mirbad_model_requests_running"):
        assert _names(got, name) == [on_n1]
    assert _get(got, "mirbad_queue_depth") == 3  # the stale replica's queue is not counted
    # Flags for every model, from the registry's names.
    assert _get(got, "mirbad_model_stalled", model="qwen-7b") == 0
    assert _get(got, "mirbad_model_slow", model="qwen-7b") == 0
    assert _get(got, "mirbad_model_slow", model="idle-one") == 0


async def test_an_empty_fleet_has_states_and_flags_only(
    client: httpx.AsyncClient, admin_key: str
) -> None:
    got = await _scrape(client, admin_key)
    assert not [n for (n, _) in got if n.startswith("mirbad_node_") or n.startswith("mirbad_model")]
    assert _get(got, "mirbad_queue_depth") is None  # unknown, not 0


# -- who may read it -----------------------------------------------------------------------


def _session_cookie(user: Any) -> str:
    browser = Client()
    browser.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={browser.cookies[settings.SESSION_COOKIE_NAME].value}"


async def test_an_operators_console_session_reads_it(
    client: httpx.AsyncClient, operator: Any
) -> None:
    await sync_to_async(_fleet)()
    cookie = await sync_to_async(_session_cookie)(operator)
    response = await client.get("/metrics", headers={"Cookie": cookie})
    assert response.status_code == 200
    got = _parse(response.text)
    assert _get(got, "mirbad_node_state", node="n1", state="Online") == 1


async def test_a_non_staff_session_is_refused(client: httpx.AsyncClient, viewer: Any) -> None:
    cookie = await sync_to_async(_session_cookie)(viewer)
    response = await client.get("/metrics", headers={"Cookie": cookie})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "scope_not_allowed"
    assert "mirbad_node" not in response.text


async def test_an_inactive_operator_is_refused(client: httpx.AsyncClient, operator: Any) -> None:
    cookie = await sync_to_async(_session_cookie)(operator)
    operator.is_active = False
    await sync_to_async(operator.save)()
    response = await client.get("/metrics", headers={"Cookie": cookie})
    assert response.status_code == 401  # the session no longer resolves to a user


@pytest.mark.parametrize(
    "cookie",
    [None, f"{settings.SESSION_COOKIE_NAME}=not-a-session", "csrftoken=abc", "=;;\x7f"],
    ids=["no credentials", "unknown session", "no session cookie", "junk"],
)
async def test_no_key_and_no_session_is_refused(
    client: httpx.AsyncClient, cookie: str | None
) -> None:
    headers = {"Cookie": cookie} if cookie is not None else {}
    response = await client.get("/metrics", headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_a_key_without_admin_is_refused_as_before(
    client: httpx.AsyncClient, chat_key: str, operator: Any
) -> None:
    response = await client.get("/metrics", headers={"Authorization": f"Bearer {chat_key}"})
    assert response.status_code == 403 and "'admin' scope" in response.text
    # A key decides when one is sent: an operator's cookie beside it does not help.
    cookie = await sync_to_async(_session_cookie)(operator)
    both = {"Authorization": f"Bearer {chat_key}", "Cookie": cookie}
    assert (await client.get("/metrics", headers=both)).status_code == 403
    bad = await client.get("/metrics", headers={"Authorization": "Bearer mbd-wrong"})
    assert bad.status_code == 401
