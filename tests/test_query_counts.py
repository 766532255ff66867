"""Query counts of every list endpoint and console page do not grow with the rows they list.

Netbox style: each page is read once over a few rows and once over ten times as many,
and the number of database queries must be the same (docs/performance.md, "Queries per
page and per list endpoint"). A count that grows is an N+1 the fleet would pay per row.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
import redis.client
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from backups.models import BackupRun
from models_registry.models import MemorySample, ModelDefinition, Placement, Route
from nodes import status_cache
from nodes.models import AuditEvent, CertRotation, MasterOperation, Node
from router import keys
from router.models import UsageDay, UsageMonth, UsageRecord
from tests.factories import make_model, make_node

FEW = 3
MANY = 30

API = [
    "/api/nodes",
    "/api/models",
    "/api/routes",
    "/api/keys",
    "/api/usage",
    "/api/usage.csv",
    "/api/audit",
    "/api/audit.csv",
    "/api/reclaim",
    "/api/nodes/n0/operations",
    "/api/backups",
    "/api/estimate-accuracy",
    "/api/models/first",
    "/api/models/first/placement-suggestions",
    "/api/nodes/n0",
    "/api/routes/r0",
    # Filtered and paged (nodes.listing, models_registry.listing).
    "/api/nodes?state=Online,Degraded&limit=50",
    "/api/nodes?model=m0&search=n&offset=0",
    "/api/models?state=Ready&limit=50",
    "/api/models?node=n0&search=m",
]

PAGES = [
    "/",
    "/overview/summary/",
    "/nodes/",
    "/nodes/n0/",
    "/nodes/n0/current/",
    "/nodes/n0/row/",
    "/models/",
    "/models/first/",
    "/models/first/row/",
    "/keys/",
    "/usage/",
    "/audit/",
    "/downloads/",
    "/routes/",
    "/backups/",
    "/backups/restore/",
    "/nodes/?state=Online&q=n&show=all",
    "/nodes/?model=m0&page=1",
    "/models/?state=Ready&q=m",
    "/models/?node=n0&page=1",
]

# What each list shows of the last row added (row MANY-1), where it names the row.
SHOWS_LAST = {
    "/api/nodes": "n29",
    "/api/models": "m29",
    "/api/routes": "r29",
    "/api/keys": "k29",
    "/api/usage": "m29",
    "/api/usage.csv": "m29",
    "/api/audit": "n29",
    "/api/audit.csv": "n29",
    "/api/nodes/n0/operations": "op-29",
    "/api/reclaim": "orphan-n29",
    "/downloads/": "orphan-n29",
    "/": "n29",
    "/nodes/": "n29",
    "/nodes/n0/": "m29",
    "/nodes/n0/current/": "m29",
    "/api/estimate-accuracy": "arch29",
    "/models/": "m29",
    "/models/first/": "n29",
    "/api/models/first": "n29",
    "/api/models/first/placement-suggestions": "n29",
    "/keys/": "k29",
    "/usage/": "m29",
    "/audit/": "n29",
    "/routes/": "r29",
    "/api/nodes?state=Online,Degraded&limit=50": "n29",
    "/api/nodes?model=m0&search=n&offset=0": "n29",
    "/api/models?state=Ready&limit=50": "m29",
    "/api/models?node=n0&search=m": "m29",
    "/nodes/?state=Online&q=n&show=all": "n29",
    "/nodes/?model=m0&page=1": "n29",
    "/models/?state=Ready&q=m": "m29",
    "/models/?node=n0&page=1": "m29",
}


def _seed(start: int, stop: int) -> None:
    """Rows start..stop-1 of every kind a list shows, each tied to node n0 and to its own."""
    n0 = Node.objects.filter(node_id="n0").first() or make_node("n0")
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    for i in range(start, stop):
        node = (
            n0 if i == 0 else make_node(f"n{i}", cert_not_after=now + dt.timedelta(days=3 + i % 20))
        )
        # An open renewal and an unanswered operation per node: the rows show both.
        CertRotation.objects.create(rotation_id=f"rot-{i}", node=node, reason="scheduled")
        MasterOperation.objects.create(
            operation_id=f"own-{i}", node=node, kind="stop", method="POST", path="/stop"
        )
        model = make_model(f"m{i}", node)
        if node is not n0:
            # Every model also on n0, and m0 on every node: both pages list 30 of them.
            Placement.objects.create(model=model, node=n0)
            Placement.objects.create(model=ModelDefinition.objects.get(served_name="m0"), node=node)
        Route.objects.create(name=f"r{i}", targets=[f"m{i}"])
        key, _ = keys.create_key(
            name=f"k{i}",
            scopes=["chat"],
            model_allowlist=[f"m{i}"],
            expires_at=now + dt.timedelta(days=30),
        )
        for row, when in (
            (UsageRecord, {"hour": hour - dt.timedelta(hours=1)}),
            (UsageDay, {"day": hour.date()}),
            (UsageMonth, {"month": hour.date().replace(day=1)}),
        ):
            row.objects.create(key=key, key_prefix=key.prefix, model=f"m{i}", requests=2, **when)
        AuditEvent.objects.create(actor="operator", action="node.approve", node_id=node.node_id)
        MasterOperation.objects.create(
            operation_id=f"op-{i}", node=n0, kind="launch", method="POST", path="/instances"
        )
        BackupRun.objects.create(kind="scheduled", finished_at=now)
        MemorySample.objects.create(
            model=model,
            served_name=f"m{i}",
            node_id=node.node_id,
            instance_id=f"i{i}",
            ready_at=f"t{i}",
            architecture=f"arch{i}",
            file_type="Q4_K_M",
            budget_bytes=2**30,
            measured_bytes=2**29,
            kind="rss",
        )
    # Every placement Ready in its node's status (the pages join instances to models),
    # and a fetched folder no model uses in its inventory (the reclaim list).
    for node in Node.objects.all():
        ids = [p.instance_id for p in Placement.objects.filter(node=node)]
        status_cache.write(
            {
                "nodeId": node.node_id,
                "state": "Online",
                "reasons": [],
                "lastSeen": time.time(),
                "instances": {i: {"instanceId": i, "state": "Ready"} for i in ids},
                "telemetry": {
                    "cpuPercent": 3.0,
                    "memory": {"percent": 40.0, "usedBytes": 4 * 2**30, "totalBytes": 10 * 2**30},
                    "weights": [{"folder": f"orphan-{node.node_id}", "fetched": True, "bytes": 1}],
                },
            }
        )


class _RedisTrips:
    """Counts round trips to Redis: each command alone, each pipeline once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trips = 0
        command = redis.client.Redis.execute_command
        execute = redis.client.Pipeline.execute

        def counted_command(client: redis.client.Redis, *args: Any, **options: Any) -> Any:
            self.trips += 1
            return command(client, *args, **options)

        def counted_execute(pipe: redis.client.Pipeline, *args: Any, **options: Any) -> Any:
            self.trips += 1
            return execute(pipe, *args, **options)

        monkeypatch.setattr(redis.client.Redis, "execute_command", counted_command)
        monkeypatch.setattr(redis.client.Pipeline, "execute", counted_execute)


def _count(client: Client | APIClient, url: str) -> tuple[int, bytes]:
    if "/models/first" in url:
        first = ModelDefinition.objects.get(served_name="m0").pk
        url = url.replace("first", str(first))
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
        # A streamed CSV queries while it is read: read it inside the count.
        body = b"".join(iter(response))
    assert response.status_code == 200, (url, response.status_code)
    return len(queries), body


def _few_and_many(
    client: Client | APIClient, url: str, redis_trips: _RedisTrips
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(queries, Redis round trips) over FEW rows, then over MANY."""
    _seed(0, FEW)
    client.get(url)  # the first read fills per-process caches; the second is the one measured
    redis_trips.trips = 0
    few, _ = _count(client, url)
    few_trips = redis_trips.trips
    _seed(FEW, MANY)
    redis_trips.trips = 0
    many, body = _count(client, url)
    many_trips = redis_trips.trips
    # The page really lists the added rows (else equal counts would prove nothing).
    last = SHOWS_LAST.get(url)
    if last is not None:
        assert last.encode() in body, f"{url} does not show {last}"
    return (few, many), (few_trips, many_trips)


@pytest.mark.parametrize("url", API)
def test_api_list_queries_do_not_grow(
    url: str, admin_key: str, status_redis: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    (few, many), (few_trips, many_trips) = _few_and_many(client, url, _RedisTrips(monkeypatch))
    assert few == many, f"{url}: {few} queries over {FEW} rows, {many} over {MANY}"
    assert few_trips == many_trips, f"{url}: {few_trips} Redis round trips, then {many_trips}"


@pytest.mark.parametrize("url", PAGES)
def test_console_page_queries_do_not_grow(
    url: str, operator: User, status_redis: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = Client()
    client.force_login(operator)
    (few, many), (few_trips, many_trips) = _few_and_many(client, url, _RedisTrips(monkeypatch))
    assert few == many, f"{url}: {few} queries over {FEW} rows, {many} over {MANY}"
    assert few_trips == many_trips, f"{url}: {few_trips} Redis round trips, then {many_trips}"
