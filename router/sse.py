"""Reading the engine's answers on their way to the client (docs/operator-guide.md, "/v1").

``StreamFilter`` forwards server-sent events as they arrive, reads the usage from them
and, when the router injected ``include_usage`` (router/transform.py ``prepare``),
removes what the injection added, so the client receives what it would have received
without it. ``UsageSniffer`` reads the usage of a non-streamed JSON answer from a
bounded head and tail, without copying the body. What llama-server sends, and why the
filter holds a finish chunk until the usage event: router/transform.py's docstring.
"""

from __future__ import annotations

import json
from typing import Any

from core.jsoninput import JSON_ERRORS

__all__ = ["MAX_EVENT", "StreamFilter", "UsageSniffer", "usage_from"]

# An SSE event ends at a blank line; a line ends in \n, \r\n or \r (WHATWG spec).
_BOUNDARIES = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n")

# An event this large cannot be the usage-only event (a few hundred bytes), so the
# filter forwards it without waiting for its end and stops inspecting it.
MAX_EVENT = 64 * 1024

_USAGE_KEY = b'"usage"'


def usage_from(doc: Any) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of a response or stream event, or None.

    Reads ``usage`` at the top (chat, completions, embeddings: no completion tokens,
    counted 0) or under ``response`` (the Responses API's ``response.completed``), and
    the Responses API's ``input_tokens``/``output_tokens`` names. A list (llama.cpp's
    answer to several prompts on its native endpoints) is summed.
    """
    if isinstance(doc, list):
        found = [u for u in map(usage_from, doc) if u is not None]
        if not found:
            return None
        return sum(u[0] for u in found), sum(u[1] for u in found)
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        inner = doc.get("response")
        usage = inner.get("usage") if isinstance(inner, dict) else None
        if not isinstance(usage, dict):
            return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if type(prompt) is not int or type(completion) is not int:
        return None
    return prompt, completion


def _event_json(event: bytes) -> Any:
    """The JSON of an event's data lines, or None (no data, [DONE], not JSON)."""
    lines = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in event.splitlines()
        if line.startswith(b"data:")
    ]
    if not lines:
        return None
    payload = lines[0] if len(lines) == 1 else b"\n".join(lines)
    if payload == b"[DONE]":
        return None
    try:
        return json.loads(payload)
    except JSON_ERRORS:
        return None


def _last_boundary(buf: bytes) -> int:
    """Offset just past the last blank line of ``buf``; 0 when there is none."""
    if buf.endswith(b"\n\n"):  # llama-server's every chunk: skip the searches
        return len(buf)
    end = 0
    for sep in _BOUNDARIES:
        i = buf.rfind(sep)
        if i >= 0 and i + len(sep) > end:
            end = i + len(sep)
    return end


def _first_boundary(buf: bytes, start: int = 0) -> int:
    """Offset just past the first blank line at or after ``start``; -1 when none."""
    end = -1
    for sep in _BOUNDARIES:
        i = buf.find(sep, start)
        if i >= 0 and (end < 0 or i + len(sep) < end):
            end = i + len(sep)
    return end


def _events(block: bytes) -> list[bytes]:
    """``block`` (ending at an event boundary) cut into events, terminators included.

    Linear in the size of the block: each separator is searched again only once the
    cut has passed its last match. A search of the rest of the block for every
    separator at every event made a coalesced block of n events cost n times its
    size (three of the four separators never occur in an engine's stream).
    """
    if b"\r" not in block:
        # Every engine's stream: "\n\n" is then the only separator (the others hold \r).
        pieces = block.split(b"\n\n")
        out = [piece + b"\n\n" for piece in pieces[:-1]]
        if pieces[-1]:
            out.append(pieces[-1])
        return out
    out = []
    pos = 0
    ahead = [block.find(sep) for sep in _BOUNDARIES]  # each one's next match at or after pos
    while pos < len(block):
        end = -1
        for k, sep in enumerate(_BOUNDARIES):
            i = ahead[k]
            if 0 <= i < pos:
                i = ahead[k] = block.find(sep, pos)
            if i >= 0 and (end < 0 or i + len(sep) < end):
                end = i + len(sep)
        if end < 0:
            out.append(block[pos:])
            break
        out.append(block[pos:end])
        pos = end
    return out


def _start_of_event_at(block: bytes, index: int) -> int:
    """Offset where the event holding ``block[index]`` begins (after the blank line
    before it), for a marker at ``index`` that holds no line break."""
    start = 0
    for sep in _BOUNDARIES:
        i = block.rfind(sep, 0, index)
        if i >= 0 and i + len(sep) > start:
            start = i + len(sep)
    return start


def _first_marked(block: bytes) -> int:
    """Offset of the first usage or finish marker in ``block``; -1 when there is none."""
    first = -1
    for marker in _MARKERS:
        i = block.find(marker)
        if i >= 0 and (first < 0 or i < first):
            first = i
    return first


_FINISH_MARKERS = (b'"finish_reason":"', b'"finish_reason": "')
_MARKERS = (_USAGE_KEY, *_FINISH_MARKERS)


def _has_finish(event: bytes) -> bool:
    # A string finish_reason (not null): the last content chunk of a choice.
    return _FINISH_MARKERS[0] in event or _FINISH_MARKERS[1] in event


def _timings_member(event: bytes, doc: dict[str, Any]) -> bytes | None:
    """The event's trailing ``,"timings":{...}`` member, as the engine spelled it."""
    if not doc or next(reversed(doc)) != "timings":
        return None
    start = event.rfind(b',"timings":{')
    close = event.rfind(b"}")
    if start < 0 or close < start:
        return None
    return event[start:close]


class StreamFilter:
    """Forward an SSE stream as it arrives; read its usage; undo an injected include_usage.

    ``feed`` returns what to send now and ``close`` what is left at the end. When the
    client asked for usage itself (``injected_usage=False``) every chunk is returned
    unchanged, as the same object, and only events containing ``"usage"`` are parsed.
    When the router injected it, whole events are returned as soon as they are
    complete, except the incomplete trailing event and a finish chunk waiting for the
    usage event right behind it (see the module docstring); the usage-only event is
    dropped. Error events are never changed.
    """

    __slots__ = ("_draining", "_held", "_injected", "_tail", "usage")

    def __init__(self, *, injected_usage: bool) -> None:
        self._injected = injected_usage
        self._tail = b""  # the incomplete trailing event, or the last bytes while draining
        self._held: list[bytes] = []
        self._draining = False  # inside an over-large event: forward, do not inspect
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> bytes:
        if not self._injected:
            self._sniff(chunk)
            return chunk
        buf = self._tail + chunk if self._tail else chunk
        out = b""
        if self._draining:
            end = _first_boundary(buf)
            if end < 0:
                self._tail = buf[-3:]
                return chunk
            self._draining = False
            # The carried bytes went out already; forward the rest of the big event.
            out = buf[len(self._tail) : end] if end > len(self._tail) else b""
            buf = buf[end:]
        end = _last_boundary(buf)
        if end:
            complete = buf if end == len(buf) else buf[:end]
            out = out + self._process(complete) if out else self._process(complete)
        tail = buf[end:] if end != len(buf) else b""
        if len(tail) > MAX_EVENT:
            out += self._release() + tail  # a held finish chunk came before it
            tail = tail[-3:]
            self._draining = True
        self._tail = tail
        return out

    def close(self) -> bytes:
        """What is left: an event cut off without its blank line, a held finish chunk."""
        tail, self._tail = self._tail, b""
        if not self._injected:
            if tail and not self._draining and _USAGE_KEY in tail:
                self._note_usage(tail)
            return b""
        if self._draining:
            self._draining = False
            return self._release()
        out = self._event(tail) if tail else b""
        return out + self._release()

    def _sniff(self, chunk: bytes) -> None:
        buf = self._tail + chunk if self._tail else chunk
        if self._draining:
            end = _first_boundary(buf)
            if end < 0:
                self._tail = buf[-3:]
                return
            self._draining = False
            buf = buf[end:]
        end = _last_boundary(buf)
        at = buf.find(_USAGE_KEY, 0, end) if end else -1
        if at >= 0:
            # Only the events from the first one with a usage on need cutting.
            for event in _events(buf[_start_of_event_at(buf, at) : end]):
                if _USAGE_KEY in event:
                    self._note_usage(event)
        tail = buf[end:] if end != len(buf) else b""
        if len(tail) > MAX_EVENT:
            tail = tail[-3:]
            self._draining = True
        self._tail = tail

    def _note_usage(self, event: bytes) -> Any:
        doc = _event_json(event)
        usage = usage_from(doc)
        if usage is not None:
            self.usage = usage
        return doc

    def _process(self, block: bytes) -> bytes:
        if self._held:
            return b"".join([self._event(event) for event in _events(block)])
        at = _first_marked(block)
        if at < 0:
            return block  # nothing to drop or hold: the common chunk
        # The events before the first one to look at go out as they are: a coalesced
        # block of many content chunks is not cut into events for its last one.
        start = _start_of_event_at(block, at)
        rest = b"".join([self._event(event) for event in _events(block[start:])])
        return block[:start] + rest if start else rest

    def _event(self, event: bytes) -> bytes:
        if _USAGE_KEY in event:
            doc = self._note_usage(event)
            if (
                isinstance(doc, dict)
                and doc.get("choices") == []
                and "error" not in doc
                and usage_from(doc) is not None
            ):
                # The event include_usage added: drop it, give its timings back.
                return self._release(_timings_member(event, doc))
            # usage inside a content chunk (llama.cpp /v1/completions): the client
            # gets it with or without include_usage, so it stays.
            return self._release() + event
        if _has_finish(event) and b'"error"' not in event:
            self._held.append(event)
            return b""
        return self._release() + event if self._held else event

    def _release(self, timings: bytes | None = None) -> bytes:
        if not self._held:
            return b""
        held, self._held = self._held, []
        last = held[-1]
        if timings and b'"timings"' not in last:
            close = last.rfind(b"}")
            if close >= 0:
                held[-1] = last[:close] + timings + last[close:]
        return b"".join(held)


class UsageSniffer:
    """Usage of a non-streamed JSON answer, from references to its first and last chunks.

    ``feed`` copies nothing: it keeps references to the chunks that cover the first and
    the last ``limit`` bytes. ``usage`` then parses only the ``"usage": {...}`` object
    found last in the tail (chat, completions) or else first in the head (llama.cpp's
    embeddings put it before ``data``). The whole body is parsed only when it is at
    most ``2 * limit`` bytes and is a list (several prompts, summed) or the search
    found nothing.
    """

    __slots__ = (
        "_done",
        "_head",
        "_head_size",
        "_limit",
        "_result",
        "_size",
        "_tail",
        "_tail_size",
    )

    def __init__(self, limit: int = 16 * 1024) -> None:
        self._limit = limit
        self._head: list[bytes] = []
        self._head_size = 0
        self._tail: list[bytes] = []
        self._tail_size = 0
        self._size = 0
        self._result: tuple[int, int] | None = None
        self._done = False  # _result is computed for what was fed

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._done = False
        self._size += len(chunk)
        if self._head_size < self._limit:
            self._head.append(chunk)
            self._head_size += len(chunk)
            return
        self._tail.append(chunk)
        self._tail_size += len(chunk)
        while len(self._tail) > 1 and self._tail_size - len(self._tail[0]) >= self._limit:
            self._tail_size -= len(self._tail.pop(0))

    @property
    def usage(self) -> tuple[int, int] | None:
        """(prompt_tokens, completion_tokens) of what was fed, or None."""
        if not self._done:
            self._result = self._compute()
            self._done = True
        return self._result

    def _compute(self) -> tuple[int, int] | None:
        small = self._size <= 2 * self._limit
        head = _first_bytes(self._head, self._limit)
        if small and head.lstrip()[:1] == b"[":
            # llama.cpp answers several prompts with a list, one usage each: sum them.
            try:
                return usage_from(json.loads(b"".join(self._head + self._tail)))
            except JSON_ERRORS:
                pass
        # Chunks are dropped only from the front of _tail while it still holds
        # ``limit`` bytes, so head + tail always ends with the last ``limit`` bytes.
        found = _find_usage(_last_bytes(self._head + self._tail, self._limit), backwards=True)
        if found is None:
            found = _find_usage(head, backwards=False)
        if found is None and small:
            # Odd spelling the search does not read (e.g. "usage" : { across lines).
            try:
                found = usage_from(json.loads(b"".join(self._head + self._tail)))
            except JSON_ERRORS:
                pass
        return found


def _first_bytes(chunks: list[bytes], n: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    for chunk in chunks:
        if size + len(chunk) >= n:
            parts.append(chunk[: n - size])  # slices the one big chunk, never joins it
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


def _last_bytes(chunks: list[bytes], n: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    for chunk in reversed(chunks):
        if size + len(chunk) >= n:
            parts.append(chunk[len(chunk) - (n - size) :])
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(reversed(parts))


def _find_usage(buf: bytes, backwards: bool) -> tuple[int, int] | None:
    """The first (or last) ``"usage": {...}`` member of ``buf`` that reads as usage."""
    decoder = json.JSONDecoder()
    pos = buf.rfind(_USAGE_KEY) if backwards else buf.find(_USAGE_KEY)
    while pos >= 0:
        i = pos + len(_USAGE_KEY)
        while i < len(buf) and buf[i] in b" \t\r\n":
            i += 1
        # Followed by ':' it is a key; inside a JSON string the quotes would be escaped.
        if i < len(buf) and buf[i] == 0x3A:
            i += 1
            while i < len(buf) and buf[i] in b" \t\r\n":
                i += 1
            if i < len(buf) and buf[i] == 0x7B:
                try:
                    # A usage object is a few hundred bytes: decode no more than 4 KiB.
                    text = buf[i : i + 4096].decode("utf-8", "replace")
                    usage, _ = decoder.raw_decode(text)
                except ValueError:
                    usage = None
                found = usage_from({"usage": usage})
                if found is not None:
                    return found
        pos = buf.rfind(_USAGE_KEY, 0, pos) if backwards else buf.find(_USAGE_KEY, pos + 1)
    return None
