"""Property tests of the wire client's framing, with h11 as the reference parser.

Hypothesis builds HTTP/1.1 answers (odd but valid header casing and whitespace,
Content-Length, chunked with random chunk sizes, extensions and trailers, bodies that
run until the close, HEAD answers, 1xx before the final answer, keep-alive and close),
a real server on 127.0.0.1 writes them split at random byte boundaries, and the
answer ``WirePool`` + ``WireResponse`` yield must be exactly the status, headers and
body h11 parses from the same bytes. Broken framings must end in a ``WireError``
(never a hang, never a body h11 would not give) whenever h11 refuses them.

The run is bounded: a modest number of examples per property and a deadline per
example; ``CI`` (set by .ci/run) selects a derandomized profile so CI runs the same
examples every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import h11
import pytest
import uvloop
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.errors import ReadTimeout, WireError
from protocol.wire import WirePool

settings.register_profile(
    "wire",
    max_examples=60,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("wire-ci", parent=settings.get_profile("wire"), derandomize=True)
PROFILE = "wire-ci" if os.environ.get("CI") else "wire"

pytestmark = pytest.mark.timeout(240)

READ_TIMEOUT = 3.0  # a client that waits for bytes that never come fails the example

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Field-value characters: visible ASCII and obs-text, with spaces and tabs inside.
VALUE_CHARS = st.sampled_from(
    [bytes([b]) for b in range(0x21, 0x7F)] + [b"\x80", b"\xe9", b"\xff", b" ", b"\t"]
)
FRAMING_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


# -- what an answer is ------------------------------------------------------------------


@dataclass
class Answer:
    """One exchange: the request's method and the exact bytes the server answers."""

    method: str
    raw: bytes
    closes: bool  # the server closes the connection after writing it
    splits: list[int] = field(default_factory=list)
    head_end: int = 0  # where the final answer's head ends (its blank line starts)


@dataclass
class Parsed:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def reference(answer: Answer) -> Parsed:
    """What h11 makes of ``answer`` as a client that sent ``answer.method``; raises
    h11.RemoteProtocolError where h11 refuses the bytes."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=answer.method, target="/", headers=[("Host", "t")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(answer.raw)
    if answer.closes:
        conn.receive_data(b"")
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = []
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            raise h11.RemoteProtocolError("the answer is incomplete")
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
            headers = [(name, value) for name, value in event.headers]
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert status is not None
            return Parsed(status, headers, bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            raise h11.RemoteProtocolError("closed before the end")


# -- strategies -----------------------------------------------------------------------


@st.composite
def header_names(draw: st.DrawFn) -> bytes:
    base = draw(
        st.sampled_from(["content-type", "x-request-id", "server", "set-cookie", "cache-control"])
        | st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=12)
    )
    cased = "".join(c.upper() if draw(st.booleans()) else c.lower() for c in base)
    if cased.lower().encode() in FRAMING_HEADERS:
        cased = "x-" + cased
    return cased.encode()


@st.composite
def header_values(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(what goes on the wire after the colon, the value a parser must report)."""
    core = b"".join(draw(st.lists(VALUE_CHARS, max_size=20))).strip(b" \t")
    left = draw(st.sampled_from([b"", b" ", b"\t", b"  ", b" \t"]))
    right = draw(st.sampled_from([b"", b" ", b"\t", b" \t "]))
    return left + core + right, core


@st.composite
def header_block(draw: st.DrawFn, max_size: int = 6) -> bytes:
    lines = []
    for _ in range(draw(st.integers(0, max_size))):
        wire, _ = draw(header_values())
        lines.append(draw(header_names()) + b":" + wire + b"\r\n")
    return b"".join(lines)


@st.composite
def chunked(draw: st.DrawFn, body: bytes) -> bytes:
    out = []
    rest = body
    while rest:
        size = draw(st.integers(1, max(1, len(rest))))
        piece, rest = rest[:size], rest[size:]
        digits = draw(st.sampled_from(["%x", "%X", "0%x", "00%X"])) % size
        ext = b""
        for _ in range(draw(st.integers(0, 2))):
            name = draw(st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=6)).encode()
            value = draw(
                st.none()
                | st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=6).map(str.encode)
                | st.text(alphabet="abc xyz", max_size=6).map(lambda t: b'"' + t.encode() + b'"')
            )
            ext += b";" + name + (b"=" + value if value is not None else b"")
        out.append(digits.encode() + ext + b"\r\n" + piece + b"\r\n")
    out.append(b"0\r\n" + draw(header_block(max_size=3)) + b"\r\n")
    return b"".join(out)


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    method = draw(st.sampled_from(["GET", "POST", "HEAD"]))
    raw = b""
    for _ in range(draw(st.integers(0, 2))):  # interim answers first
        code = draw(st.sampled_from([100, 102, 103]))
        raw += b"HTTP/1.1 %d Interim\r\n%b\r\n" % (code, draw(header_block(max_size=3)))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0"]))
    status = draw(
        st.sampled_from([200, 201, 204, 206, 304, 400, 404, 418, 500, 502, 503])
        | st.integers(200, 599)
    )
    reason = draw(st.sampled_from([b" OK", b" Some Reason", b" ", b""]))
    headers = draw(header_block())
    body = draw(st.binary(max_size=3000))
    no_body = method == "HEAD" or status in (204, 304)
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if status == 204:
        framing = "none"  # 204 carries no framing headers at all
    close = version == b"HTTP/1.0" or draw(st.booleans())
    if framing == "length":
        headers += b"Content-Length: %d\r\n" % len(body)
        payload = b"" if no_body else body
    elif framing == "chunked":
        headers += b"Transfer-Encoding: chunked\r\n"
        payload = b"" if no_body else draw(chunked(body))
    elif framing == "close":
        payload = b"" if no_body else body
        close = True
    else:
        payload = b""
    if close and version == b"HTTP/1.1":
        headers += b"Connection: close\r\n"
    raw += version + b" %d" % status + reason + b"\r\n" + headers
    return Answer(method=method, raw=raw + b"\r\n" + payload, closes=close, head_end=len(raw))


def with_splits(answer: st.SearchStrategy[Answer]) -> st.SearchStrategy[Answer]:
    @st.composite
    def split(draw: st.DrawFn) -> Answer:
        a = draw(answer)
        cuts = draw(st.lists(st.integers(1, max(1, len(a.raw) - 1)), max_size=6, unique=True))
        a.splits = sorted(cuts)
        return a

    return split()


@st.composite
def broken(draw: st.DrawFn) -> Answer:
    """A valid answer with one flaw in its framing; the server closes after it."""
    a = draw(answers())
    head, payload = a.raw[: a.head_end - 2], a.raw[a.head_end + 2 :]
    flaw = draw(
        st.sampled_from(
            [
                "truncated",
                "bad-length",
                "two-lengths",
                "length-and-chunked",
                "bad-chunk-size",
                "chunk-without-crlf",
                "other-coding",
                "header-without-colon",
                "space-before-colon",
                "bad-name-char",
                "control-in-value",
                "bad-status-line",
            ]
        )
    )
    event(f"flaw: {flaw}")
    if flaw == "truncated":
        raw = a.raw[: draw(st.integers(0, max(0, len(a.raw) - 1)))]
    elif flaw == "bad-length":
        bad = draw(st.sampled_from([b"abc", b"-5", b"1 2", b"+5", b"0x10", b"", b"9" * 30]))
        raw = head + b"\r\nContent-Length: " + bad + b"\r\n\r\n" + payload
    elif flaw == "two-lengths":
        raw = head + b"\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxy"
    elif flaw == "length-and-chunked":
        raw = (
            head
            + b"\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"3\r\nabc\r\n0\r\n\r\n"
        )
    elif flaw == "bad-chunk-size":
        size = draw(st.sampled_from([b"xyz", b"-1", b"", b"f" * 24, b"1 2"]))
        raw = head + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabc\r\n0\r\n\r\n"
    elif flaw == "chunk-without-crlf":
        raw = head + b"\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n"
    elif flaw == "other-coding":
        coding = draw(st.sampled_from([b"gzip", b"chunked, gzip", b"identity", b"bogus"]))
        raw = head + b"\r\nTransfer-Encoding: " + coding + b"\r\n\r\nbody-bytes"
    elif flaw == "header-without-colon":
        raw = head + b"\r\nNoColonHere\r\n\r\n" + payload
    elif flaw == "space-before-colon":
        raw = head + b"\r\nX-Spaced : v\r\n\r\n" + payload
    elif flaw == "bad-name-char":
        char = draw(st.sampled_from([b"(", b")", b"/", b"@", b"[", b"\x01", b"\xff", b"{"]))
        raw = head + b"\r\nX-Bad" + char + b"Name: v\r\n\r\n" + payload
    elif flaw == "control-in-value":
        char = draw(st.sampled_from([b"\x00", b"\x01", b"\x7f", b"\r", b"\x1b"]))
        raw = head + b"\r\nX-Ctl: a" + char + b"b\r\n\r\n" + payload
    else:
        line = draw(
            st.sampled_from(
                [b"HTTP/1.1 20 OK", b"HTTP/2 200 OK", b"HTP/1.1 200 OK", b"HTTP/1.1 1000 OK",
                 b"HTTP/1.1  200 OK", b"http/1.1 200 OK", b"HTTP/1.1 2OO OK"]
            )
        )  # fmt: skip
        raw = line + b"\r\nContent-Length: 2\r\n\r\nok"
    return Answer(method=a.method, raw=raw, closes=True)


# -- the server and the client's side ---------------------------------------------------


async def _serve_all(plan: deque[Answer], reader: Any, writer: Any) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while plan:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            answer = plan.popleft()
            start = 0
            for cut in [*answer.splits, len(answer.raw)]:
                if cut > start:
                    writer.write(answer.raw[start:cut])
                    await writer.drain()
                    await asyncio.sleep(0.001)  # a read of its own, most of the time
                    start = cut
            if answer.closes:
                return
    except ConnectionError:
        return
    finally:
        writer.close()


async def _exchange_all(answers: list[Answer], whole: bool) -> list[Parsed | WireError]:
    """Ask once per answer on one pool; each outcome is what the client yielded or raised."""
    plan = deque(answers)
    tasks: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        with contextlib.suppress(asyncio.CancelledError):  # cancelled at teardown
            await _serve_all(plan, reader, writer)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = WirePool(connect_timeout=5)
    outcomes: list[Parsed | WireError] = []
    try:
        for answer in answers:
            try:
                async with asyncio.timeout(READ_TIMEOUT * 3):
                    response = await pool.request(
                        answer.method, "127.0.0.1", port, "/", read_timeout=READ_TIMEOUT
                    )
                    async with response:
                        if whole:
                            body = await response.read()
                        else:
                            body = b"".join([c async for c in response.iter_chunks()])
                outcomes.append(
                    Parsed(
                        response.status,
                        [(n.lower(), v) for n, v in response.raw_headers],
                        body,
                    )
                )
            except WireError as exc:
                outcomes.append(exc)
    finally:
        await pool.close()
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
    return outcomes


LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def _run(loop: str, work: Coroutine[Any, Any, Any]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(work)


# -- the properties -------------------------------------------------------------------


@settings(settings.get_profile(PROFILE))
@given(
    exchange=st.lists(with_splits(answers()), min_size=1, max_size=3),
    whole=st.booleans(),
    loop=st.sampled_from(sorted(LOOPS)),
)
def test_valid_answers_are_read_exactly_as_h11_reads_them(
    exchange: list[Answer], whole: bool, loop: str
) -> None:
    expected = [reference(a) for a in exchange]
    outcomes = _run(loop, _exchange_all(exchange, whole))
    for answer, want, got in zip(exchange, expected, outcomes, strict=True):
        assert not isinstance(got, WireError), f"{got!r} for {answer.raw!r}"
        assert got == want, answer.raw


@settings(settings.get_profile(PROFILE))
@given(answer=with_splits(broken()), whole=st.booleans(), loop=st.sampled_from(sorted(LOOPS)))
def test_broken_framing_is_a_wire_error_never_a_wrong_answer(
    answer: Answer, whole: bool, loop: str
) -> None:
    try:
        want: Parsed | None = reference(answer)
    except h11.RemoteProtocolError:
        want = None
    [got] = _run(loop, _exchange_all([answer], whole))
    event(f"h11 {'refuses' if want is None else 'accepts'}, the client {type(got).__name__}")
    # The server closed after the answer: waiting for more bytes is a hang, not a verdict.
    assert not isinstance(got, ReadTimeout), answer.raw
    if want is None:
        assert isinstance(got, WireError), f"h11 refuses {answer.raw!r}; the client gave {got}"
    elif not isinstance(got, WireError):
        assert got == want, answer.raw  # stricter than h11 is allowed; different is not
