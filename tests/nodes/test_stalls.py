"""nodes.stalls: the per-node record of flagged engines the monitor writes at each sample."""

from __future__ import annotations

import asyncio
import time

import pytest

from nodes import stalls, status_cache, telemetry
from tests.telemetry_support import engine, history, sample

__all__ = ["history"]  # the fixture, imported to be used


def _feed(node_id: str, make, seconds: float, now: float) -> None:  # type: ignore[no-untyped-def]
    async def run() -> None:
        count = int(seconds // 5) + 1
        for i in range(count):
            at = now - 5 * (count - 1 - i)
            point = await telemetry.arecord(node_id, make(i), now=at)
            await stalls.aupdate(node_id, point["t"])

    asyncio.run(run())


@pytest.mark.usefixtures("history")
def test_the_record_holds_the_flagged_engines_and_expires_with_the_samples() -> None:
    now = time.time()
    frozen, busy = "m1-p1", "m2-p2"
    _feed("n1", lambda i: sample(engine(frozen, running=1, prompt=7, gen=7, kv=0.5),
                                 engine(busy, running=1, prompt=100 * i, gen=50 * i)),
          seconds=310, now=now)  # fmt: skip
    found = stalls.flags_many(["n1", "n2"], now=now + 1)
    assert list(found["n1"]) == [frozen] and found["n1"][frozen]["stalled"]
    assert found["n2"] == {}  # never recorded
    # A node that stopped reporting: its record is no answer half a minute later.
    assert stalls.flags_many(["n1"], now=now + stalls.FLAGS_TTL_SECONDS + 1) == {"n1": {}}
    assert 0 < status_cache.sync_client().ttl(stalls.flags_key("n1")) <= stalls.FLAGS_TTL_SECONDS


@pytest.mark.usefixtures("history")
def test_a_short_history_flags_nothing() -> None:
    now = time.time()
    _feed("n1", lambda i: sample(engine("m1-p1", running=1, prompt=7, gen=7, kv=0.5)),
          seconds=120, now=now)  # fmt: skip
    assert stalls.flags_many(["n1"], now=now) == {"n1": {}}
