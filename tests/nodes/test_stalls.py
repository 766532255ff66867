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


@pytest.mark.usefixtures("history")
def test_the_monitors_kept_points_give_the_same_history_and_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The monitor keeps each node's newest points (telemetry.Recent) instead of reading
    and decoding 96 of them at every sample: what it writes must not differ. Two nodes
    get the same samples (a stalled engine, a counter reset, a gap, minutes crossed), one
    recorded the old way, one with a Recent that a worker took over half-way."""
    now = time.time()
    start = now - 5 * 119

    def make(i: int) -> dict:  # type: ignore[type-arg]
        gen = 0 if 60 <= i < 70 else 10 * i  # frozen for 50 s, then it moves again
        return sample(engine("m1-p1", running=1, waiting=2, gen=gen, kv=0.5), cpu=float(i))

    async def run() -> None:
        recent = telemetry.Recent(stalls.READBACK)
        for i in range(120):
            if i in (40, 41):
                continue  # a gap: no rates across it
            at = start + 5 * i
            if i == 80:
                recent = telemetry.Recent(stalls.READBACK)  # a new worker: read back once
            point = await telemetry.arecord("old", make(i), now=at)
            old = await stalls.aupdate("old", point["t"])
            point = await telemetry.arecord("kept", make(i), now=at, recent=recent)
            kept = await stalls.aupdate("kept", point["t"], points=recent.points)
            assert kept == old, i

    asyncio.run(run())
    client = status_cache.sync_client()
    for key in (telemetry.fine_key, telemetry.coarse_key):
        assert client.lrange(key("kept"), 0, -1) == client.lrange(key("old"), 0, -1)

    # Loaded, a sample reads nothing back from Redis.
    recent = telemetry.Recent(stalls.READBACK)
    asyncio.run(telemetry.arecord("kept", make(120), now=now + 5, recent=recent))

    def no_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("read back although the points are kept")

    async def again() -> None:
        monkeypatch.setattr(type(status_cache.async_client()), "lrange", no_reads)
        point = await telemetry.arecord("kept", make(121), now=now + 10, recent=recent)
        await stalls.aupdate("kept", point["t"], points=recent.points)

    asyncio.run(again())
    assert len(recent.points) == stalls.READBACK
