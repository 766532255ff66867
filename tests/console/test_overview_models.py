"""The Overview's models tile and its models' Needs attention lines, read from plain
values over the whole registry (issue 19): each situation once, in served-name order."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from agent.engines._spec import fingerprint, parse_launch_spec
from models_registry import lifecycle
from nodes import stalls, telemetry
from tests.factories import make_model, make_node, set_status
from tests.telemetry_support import engine, history, sample

__all__ = ["history"]  # the fixture, imported to be used


def _stall(node_id: str, instance_id: str) -> None:
    """Five minutes of a busy engine making no tokens, as the monitor records them."""
    now = time.time()

    async def run() -> None:
        count = 62
        for i in range(count):
            at = now - 5 * (count - 1 - i)
            point = sample(engine(instance_id, running=2, prompt=500, gen=500, kv=0.4))
            await telemetry.arecord(node_id, point, now=at)
            await stalls.aupdate(node_id, at)

    asyncio.run(run())


def _attention(page: str) -> list[str]:
    section = page.split('<section id="attention">', 1)[1].split("</section>", 1)[0]
    return [re.sub(r"<[^>]+>", "", line) for line in re.findall(r"<li[^>]*>(.*?)</li>", section)]


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis", "history")
def test_the_models_tile_and_lines_cover_every_situation(operator: Any) -> None:
    n1, n2 = make_node("n1"), make_node("n2")
    ready = make_model("a-ready", n1)
    failed = make_model("b-failed", n1)
    stalled = make_model("c-stalled", n1)
    changed = make_model("d-changed", n1)
    both = make_model("e-both", n2)  # Ready on n1, Failed on n2: Ready wins, no line
    both.placements.create(node=n1)
    make_model("f-offline", make_node("n3"))  # its node has no record: Offline
    make_model("g-unplaced")
    iid = {m.served_name: m.placements.get(node=n1).instance_id for m in
           (ready, failed, stalled, changed, both)}  # fmt: skip
    placement = changed.placements.get()
    spec = lifecycle.launch_spec(changed, placement)
    running = {
        "state": "Ready",
        "fingerprint": fingerprint(parse_launch_spec(spec), "0.6.0-dev"),
        "executable": {"name": "llama.cpp", "version": "0.6.0-dev"},
    }
    changed.settings = {"context_size": 8192}  # saved after it started
    changed.save()
    _stall("n1", iid["c-stalled"])
    set_status(n1, instances={
        iid["a-ready"]: {"instanceId": iid["a-ready"], "state": "Ready",
                         "fingerprint": fingerprint(parse_launch_spec(
                             lifecycle.launch_spec(ready, ready.placements.get())), "0.6.0-dev"),
                         "executable": {"name": "llama.cpp", "version": "0.6.0-dev"}},
        iid["b-failed"]: {"instanceId": iid["b-failed"], "state": "Failed", "error": "exit 1"},
        iid["c-stalled"]: {"instanceId": iid["c-stalled"], "state": "Ready"},
        iid["d-changed"]: {"instanceId": iid["d-changed"], **running},
        iid["e-both"]: {"instanceId": iid["e-both"], "state": "Ready"},
    })  # fmt: skip
    on_n2 = both.placements.get(node=n2).instance_id
    set_status(n2, instances={on_n2: {"instanceId": on_n2, "state": "Failed", "error": "oom"}})
    client = Client()
    client.force_login(operator)

    for url in ("/", "/overview/summary/"):
        page = client.get(url).content.decode()
        # Ready: a, c, d, e; placed: all but g; defined: 7.
        assert "<strong>4 / 6</strong> models Ready / placed" in page
        assert "<small>7 defined</small>" in page
        models = [line for line in _attention(page) if line.split(":")[0].startswith(
            ("a-", "b-", "c-", "d-", "e-", "f-", "g-"))]  # fmt: skip
        assert models == [
            "b-failed: Failed: exit 1",
            "c-stalled: Stalled: On n1: " + stalls.STALLED_REASON,
            "d-changed: Restart pending: its settings changed since it started.",
        ], page


def _running(model: Any) -> dict[str, Any]:
    """The instance record of a model started as defined (its restart is not pending)."""
    placement = model.placements.get()
    spec = parse_launch_spec(lifecycle.launch_spec(model, placement))
    return {
        "instanceId": placement.instance_id,
        "state": "Ready",
        "fingerprint": fingerprint(spec, "0.6.0-dev"),
        "executable": {"name": "llama.cpp", "version": "0.6.0-dev"},
    }


@pytest.mark.django_db
@pytest.mark.usefixtures("status_redis", "history")
def test_running_models_are_checked_in_a_fixed_number_of_queries(operator: Any) -> None:
    """Every running model may be restart pending: their check reads them all at once."""
    node = make_node("n1")
    client = Client()
    client.force_login(operator)
    counts = []
    for total in (3, 30):
        while len(models := list(node.placements.all())) < total:
            make_model(f"m{len(models):02d}", node)
        set_status(node, instances={
            p.instance_id: _running(p.model) for p in node.placements.select_related("model")
        })  # fmt: skip
        with CaptureQueriesContext(connection) as queries:
            page = client.get("/overview/summary/").content.decode()
        assert f"<strong>{total} / {total}</strong> models Ready / placed" in page
        assert "Restart pending" not in page
        counts.append(len(queries))
    assert counts[0] == counts[1], counts
