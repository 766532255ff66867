"""The logs the console follows: rings, long-polls, engine log tails and their cap, and
``GET /agent/v1/logs`` (docs/decisions.md D62)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_support import Pki, RunningAgent, client_context
from test_end_to_end import launch_ready, start_agent

from agent._config import AgentConfig, ExecutableEntry
from agent.engines.process._handle import cap_log
from agent.telemetry._logs import (
    AGENT_LOG,
    MAX_LINE_CHARS,
    FileTail,
    LogBook,
    LogRing,
    RingHandler,
    install_agent_log,
)

pytestmark = pytest.mark.timeout(60)


def test_the_ring_keeps_the_last_lines_with_growing_numbers() -> None:
    ring = LogRing(size=2000)
    assert ring.last_seq == 0 and ring.tail(10) == [] and ring.after(0, 10) == []
    ring.extend([f"line {i}" for i in range(1, 2501)])
    assert ring.last_seq == 2500
    kept = ring.tail(2000)
    assert len(kept) == 2000 and kept[0] == {"seq": 501, "text": "line 501"}
    assert [x["seq"] for x in ring.after(2400, 3)] == [2401, 2402, 2403]
    # Asking after a dropped line starts at the oldest kept one.
    assert ring.after(10, 1) == [{"seq": 501, "text": "line 501"}]
    assert ring.after(2500, 5) == []
    # A number from a previous agent run (beyond the newest): the last lines again.
    assert [x["seq"] for x in ring.after(9999, 2)] == [2499, 2500]
    ring.append("x" * (MAX_LINE_CHARS + 10))
    assert ring.tail(1)[0]["text"].endswith("x [... 10 more characters]")


async def test_a_long_poll_returns_on_a_new_line_and_on_timeout() -> None:
    ring = LogRing()
    ring.append("first")
    started = time.monotonic()
    await ring.wait_after(1, 0.3)  # nothing new: the timeout
    assert 0.25 < time.monotonic() - started < 2
    # A line appended from another thread (a logging call in a worker) wakes the waiter.
    timer = threading.Timer(0.2, ring.append, args=("second",))
    started = time.monotonic()
    timer.start()
    await ring.wait_after(1, 10)
    assert time.monotonic() - started < 2 and ring.after(1, 10)[0]["text"] == "second"
    started = time.monotonic()
    await ring.wait_after(0, 10)  # already there: at once
    assert time.monotonic() - started < 0.1


def test_the_agent_handler_keeps_formatted_records_and_installs_once() -> None:
    ring = LogRing()
    handler = RingHandler(ring)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("mirbad.agent.test-logs")
    logger.addHandler(handler)
    try:
        logger.warning("disk %s is full", "/srv")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("it failed")
    finally:
        logger.removeHandler(handler)
    texts = [x["text"] for x in ring.tail(50)]
    assert texts[0] == "WARNING mirbad.agent.test-logs: disk /srv is full"
    assert texts[1] == "ERROR mirbad.agent.test-logs: it failed"
    assert texts[-1] == "ValueError: boom"  # the traceback, line by line
    first = install_agent_log()
    assert install_agent_log() is first and first.ring is AGENT_LOG
    assert logging.getLogger("mirbad.agent").handlers.count(first) == 1


def test_a_tail_follows_appends_partial_lines_and_a_new_file(tmp_path: Path) -> None:
    path = tmp_path / "ss-m.log"
    ring = LogRing()
    tail = FileTail(path, ring)
    tail.poll()  # no file yet
    assert ring.last_seq == 0
    with open(path, "ab") as out:
        out.write(b"old 1\nold 2\n")
        out.flush()
        tail.poll()
        out.write(b"new 1\nnew ")
        out.flush()
        tail.poll()
        assert [x["text"] for x in ring.tail(10)] == ["old 1", "old 2", "new 1"]
        out.write(b"2\n")
        out.flush()
        tail.poll()
    assert ring.tail(1) == [{"seq": 4, "text": "new 2"}]
    # A restart rotated the file away (another inode): the new file is read from its start.
    os.replace(path, tmp_path / "ss-m.log.1")
    path.write_bytes(b"after restart\n")
    tail.poll()
    assert ring.tail(1)[0]["text"] == "after restart"


def test_the_cap_truncates_in_place_and_keeps_the_tail_in_dot_1(tmp_path: Path) -> None:
    path = tmp_path / "ss-m.log"
    ring = LogRing()
    tail = FileTail(path, ring, cap=lambda p: cap_log(p, cap=1000, keep=300))
    # The engine's side: one descriptor opened O_APPEND, as open_log hands it over.
    writer = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for i in range(80):
            os.write(writer, f"engine line {i:04d}\n".encode())  # 17 bytes each: 1360
        tail.poll()  # read all 80, then capped
        assert ring.last_seq == 80 and path.stat().st_size == 0
        kept = (tmp_path / "ss-m.log.1").read_text().splitlines()
        assert kept[-1] == "engine line 0079" and 10 < len(kept) <= 300 // 17 + 1
        assert all(line.startswith("engine line ") for line in kept)  # whole lines only
        os.write(writer, b"after the cap\n")  # the same descriptor: lands at offset 0
        assert path.read_bytes() == b"after the cap\n"
        tail.poll()
        assert ring.tail(1)[0]["text"] == "after the cap" and ring.last_seq == 81
        # A second cap moves the first tail to .2.
        for _ in range(80):
            os.write(writer, b"x" * 16 + b"\n")
        tail.poll()
        assert (tmp_path / "ss-m.log.2").read_text().splitlines()[-1] == "engine line 0079"
    finally:
        os.close(writer)
    assert not cap_log(tmp_path / "missing.log", cap=1) and not cap_log(path, cap=10**6)


async def test_closing_the_book_answers_a_pending_long_poll_at_once() -> None:
    ring = LogRing()
    ring.append("only")
    book = LogBook(instances=list, log_path=Path, agent_ring=ring)
    pending = asyncio.ensure_future(book.read("agent", {"after": "1", "wait": "25"}))
    await asyncio.sleep(0.2)
    assert not pending.done()
    started = time.monotonic()
    await book.close()  # the agent is stopping
    answer = await asyncio.wait_for(pending, 5)
    assert time.monotonic() - started < 1
    assert answer == {"name": "agent", "lines": [], "next": 1}


# -- the endpoints -------------------------------------------------------------------------


async def get(agent: RunningAgent, path: str) -> tuple[int, Any]:
    async with agent.session.get(agent.url(path)) as resp:
        return resp.status, await resp.json()


async def test_the_agent_log_over_http_with_a_long_poll(running_agent: RunningAgent) -> None:
    install_agent_log()
    logger = logging.getLogger("mirbad.agent.test-http")
    logger.warning("a line before the console looked")
    status, listed = await get(running_agent, "/agent/v1/logs")
    assert status == 200 and listed == {"logs": [{"name": "agent", "kind": "agent"}]}
    status, body = await get(running_agent, "/agent/v1/logs/agent?limit=5")
    assert status == 200 and body["name"] == "agent" and len(body["lines"]) <= 5
    assert body["lines"][-1]["text"].endswith("a line before the console looked")
    assert body["next"] == body["lines"][-1]["seq"]
    # Long-poll: nothing yet, a line arrives 0.3 s later, the answer comes at once.
    asyncio.get_running_loop().call_later(0.3, logger.warning, "a new line")
    started = time.monotonic()
    status, polled = await get(running_agent, f"/agent/v1/logs/agent?after={body['next']}&wait=10")
    assert status == 200 and time.monotonic() - started < 5
    assert polled["lines"][-1]["text"].endswith("a new line")
    assert polled["next"] == polled["lines"][-1]["seq"] > body["next"]
    # Nothing new within wait: an empty answer with the same next.
    status, empty = await get(running_agent, f"/agent/v1/logs/agent?after={polled['next']}&wait=1")
    assert status == 200 and empty == {"name": "agent", "lines": [], "next": polled["next"]}


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("after=-1", "after"),
        ("after=abc", "after"),
        ("after=9007199254740993", "after"),
        ("limit=0", "limit"),
        ("limit=2001", "limit"),
        ("limit=1.5", "limit"),
        ("wait=26", "wait"),
        ("wait=%20", "wait"),
    ],
)
async def test_bad_parameters_are_400s_naming_the_parameter(
    running_agent: RunningAgent, query: str, field: str
) -> None:
    status, body = await get(running_agent, f"/agent/v1/logs/agent?{query}")
    assert status == 400, body
    assert body["error"]["code"] == "invalid_request"
    assert body["error"]["message"].startswith(f"{field} must be a whole number")
    assert body["error"]["details"] == {"field": field}


async def test_an_unknown_log_is_a_404(running_agent: RunningAgent) -> None:
    for name in ("nope", "..%2Fetc", "agent2"):
        status, body = await get(running_agent, f"/agent/v1/logs/{name}")
        assert status == 404 and body["error"]["code"] == "not_found", body


async def test_only_the_master_reads_the_logs(running_agent: RunningAgent, pki: Pki) -> None:
    ctx = client_context(pki, pki.node("n3"), running_agent.tmp / "n3")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        for path in ("/agent/v1/logs", "/agent/v1/logs/agent"):
            async with session.get(running_agent.url(path)) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == "client_not_master"


async def test_an_engine_log_is_listed_and_followed(
    pki: Pki,
    state_dir: Path,
    tmp_path: Path,
    make_config: Callable[..., AgentConfig],
    fake_engine: ExecutableEntry,
) -> None:
    agent = await start_agent(pki, state_dir, tmp_path, make_config(executables=(fake_engine,)))
    try:
        await launch_ready(agent, "m-1")
        status, listed = await get(agent, "/agent/v1/logs")
        assert listed["logs"][1] == {
            "name": "m-1", "kind": "engine", "instanceId": "m-1", "state": "Ready",
        }  # fmt: skip
        status, body = await get(agent, "/agent/v1/logs/m-1")
        texts = [x["text"] for x in body["lines"]]
        assert texts[0].startswith("--- ") and "agent: starting m-1" in texts[0]
        assert any("fake engine: listening on" in t for t in texts), texts
        # A request the engine logs shows up in a long-poll.
        long_poll = asyncio.ensure_future(
            get(agent, f"/agent/v1/logs/m-1?after={body['next']}&wait=10")
        )
        await asyncio.sleep(0.2)
        async with agent.session.get(agent.url("/agent/v1/proxy/m-1/echo")) as resp:
            assert resp.status == 200
        status, polled = await asyncio.wait_for(long_poll, 10)
        assert status == 200 and any("/echo" in x["text"] for x in polled["lines"]), polled
    finally:
        await agent.session.close()
        await agent.server.stop()
