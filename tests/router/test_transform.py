"""router.transform: pass-through, include_usage injection and stripping, usage, dimensions.

The streams are real llama-server captures (tests/router/fixtures/README.md).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from router.errors import V1Error
from router.sse import MAX_EVENT, StreamFilter, UsageSniffer, usage_from
from router.transform import Prepared, prepare, transform_embeddings

FIXTURES = Path(__file__).parent / "fixtures"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


def _fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


CHAT_PLAIN = _fixture("llamacpp_chat_stream.txt")
CHAT_USAGE = _fixture("llamacpp_chat_stream_include_usage.txt")
COMPLETION_PLAIN = _fixture("llamacpp_completion_stream.txt")
COMPLETION_USAGE = _fixture("llamacpp_completion_stream_include_usage.txt")
# The include_usage chat capture as events: role, tokens..., finish, usage-only, [DONE].
EVENTS = [event + b"\n\n" for event in CHAT_USAGE.split(b"\n\n")[:-1]]
FINISH, USAGE_ONLY, DONE = EVENTS[-3:]


def _normalise(stream: bytes) -> bytes:
    """Blank out what differs between two runs: ids, timestamps, timing and cache numbers."""
    stream = re.sub(rb'"id":"[^"]*"', b'"id":"X"', stream)
    stream = re.sub(rb'"created":\d+', b'"created":0', stream)
    stream = re.sub(rb'"timings":\{[^}]*\}', b'"timings":{}', stream)
    return re.sub(rb'"cached_tokens":\d+', b'"cached_tokens":0', stream)


def _run(stream: bytes, cuts: list[int], *, injected: bool) -> tuple[bytes, StreamFilter]:
    f = StreamFilter(injected_usage=injected)
    out = []
    last = 0
    for cut in [*cuts, len(stream)]:
        out.append(f.feed(stream[last:cut]))
        last = cut
    out.append(f.close())
    return b"".join(out), f


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


# --- prepare: byte-for-byte pass-through --------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (CHAT, {"messages": []}),
        (CHAT, {"messages": [], "stream": False}),
        (CHAT, {"messages": [], "stream": True, "stream_options": {"include_usage": True}}),
        (COMPLETIONS, {"prompt": "x", "stream": "true"}),  # not a JSON true: not streamed
        (EMBEDDINGS, {"input": "x"}),
        (EMBEDDINGS, {"input": "x", "dimensions": None}),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "stream": True}),
        ("/v1/responses", {"input": "x", "stream": True}),
    ],
)
def test_passthrough_returns_the_same_bytes_object(path: str, fields: dict[str, Any]) -> None:
    body = _body(**fields)
    for data in (None, json.loads(body)):
        prepared = prepare(path, body, emulate_dimensions=True, data=data)
        assert prepared.body is body
        assert not prepared.injected_usage and prepared.dimensions is None


def test_dimensions_without_emulation_is_forwarded_untouched() -> None:
    body = _body(input="x", dimensions=8)
    prepared = prepare(EMBEDDINGS, body, emulate_dimensions=False)
    assert prepared.body is body and prepared.dimensions is None


def test_not_json_is_left_to_the_router() -> None:
    body = b'{"stream": true, not json'
    assert prepare(CHAT, body, emulate_dimensions=True).body is body
    body = b'[1, "stream"]'
    assert prepare(CHAT, body, emulate_dimensions=True).body is body


def test_stream_flag_is_reported() -> None:
    body = _body(messages=[], stream=True, stream_options={"include_usage": True})
    assert prepare(CHAT, body, emulate_dimensions=False).stream is True
    assert prepare(CHAT, _body(messages=[]), emulate_dimensions=False).stream is False


# --- prepare: include_usage injection --------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_injection_splices_without_reserialising(path: str) -> None:
    # Odd spacing, an escaped unicode string and a float spelled 1e0: all kept exactly.
    body = (
        b'{ "model": "m", "prompt": "\\u00e9 caf\xc3\xa9", "temperature": 1e0, "stream": true }\n'
    )
    prepared = prepare(path, body, emulate_dimensions=False)
    assert prepared.injected_usage and prepared.stream
    assert prepared.body == (
        b'{ "model": "m", "prompt": "\\u00e9 caf\xc3\xa9", "temperature": 1e0, "stream": true '
        b',"stream_options":{"include_usage":true}}\n'
    )
    sent = json.loads(prepared.body)
    assert sent["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in sent.items() if k != "stream_options"} == json.loads(body)


def test_injection_keeps_other_stream_options() -> None:
    body = _body(messages=[], stream=True, stream_options={"include_usage": False, "continuous": 1})
    prepared = prepare(CHAT, body, emulate_dimensions=False, data=json.loads(body))
    assert prepared.injected_usage
    sent = json.loads(prepared.body)
    assert sent["stream_options"] == {"include_usage": True, "continuous": 1}
    assert list(sent) == list(json.loads(body))  # member order kept
    assert sent["messages"] == [] and sent["stream"] is True


def test_injection_with_null_stream_options_and_lone_surrogate() -> None:
    body = b'{"model":"m","prompt":"\\ud800","stream":true,"stream_options":null}'
    prepared = prepare(COMPLETIONS, body, emulate_dimensions=False)
    assert prepared.injected_usage
    assert json.loads(prepared.body) == {
        "model": "m",
        "prompt": "\ud800",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_garbage_stream_options_are_not_repaired() -> None:
    body = _body(messages=[], stream=True, stream_options="yes")
    prepared = prepare(CHAT, body, emulate_dimensions=False)
    assert prepared.body is body and prepared.stream and not prepared.injected_usage


def test_injection_without_a_plain_object_reserialises() -> None:
    body = b"\xef\xbb\xbf" + _body(messages=[], stream=True)  # a UTF-8 BOM
    prepared = prepare(CHAT, body, emulate_dimensions=False)
    assert prepared.injected_usage
    assert json.loads(prepared.body)["stream_options"] == {"include_usage": True}


# --- prepare: dimensions -----------------------------------------------------------------


def test_dimensions_are_removed_and_recorded() -> None:
    body = _body(input=["a", "b"], dimensions=8, encoding_format="base64", user="u")
    prepared = prepare(EMBEDDINGS, body, emulate_dimensions=True, data=json.loads(body))
    assert prepared.dimensions == 8 and prepared.encoding_format == "base64"
    assert json.loads(prepared.body) == {
        "model": "m",
        "input": ["a", "b"],
        "encoding_format": "base64",
        "user": "u",
    }


@pytest.mark.parametrize("value", [0, -1, 1.5, 3.0, True, False, "3", [3], {}])
def test_bad_dimensions_are_refused(value: object) -> None:
    body = _body(input="x", dimensions=value)
    with pytest.raises(V1Error) as caught:
        prepare(EMBEDDINGS, body, emulate_dimensions=True)
    error = caught.value
    assert error.status == 400 and error.param == "dimensions"
    shaped = json.loads(error.body())["error"]
    assert shaped["type"] == "invalid_request_error" and shaped["param"] == "dimensions"
    assert shaped["code"] == "invalid_request_error"


def test_dimensions_above_a_known_native_size_are_refused_up_front() -> None:
    body = _body(input="x", dimensions=65)
    with pytest.raises(V1Error) as caught:
        prepare(EMBEDDINGS, body, emulate_dimensions=True, native_dimensions=64)
    assert caught.value.status == 400 and "64" in caught.value.message
    assert prepare(EMBEDDINGS, _body(input="x", dimensions=64), emulate_dimensions=True,
                   native_dimensions=64).dimensions == 64  # fmt: skip


# --- transform_embeddings ----------------------------------------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def test_float_embeddings_truncated_and_renormalised() -> None:
    body = _fixture("llamacpp_embeddings.json")
    original = json.loads(body)
    out = json.loads(transform_embeddings(Prepared(b"", dimensions=8), body))
    assert {k: v for k, v in out.items() if k != "data"} == {
        k: v for k, v in original.items() if k != "data"
    }
    assert len(out["data"]) == len(original["data"]) == 2
    for got, item in zip(out["data"], original["data"], strict=True):
        assert {k: v for k, v in got.items() if k != "embedding"} == {
            k: v for k, v in item.items() if k != "embedding"
        }
        vector = np.asarray(got["embedding"])
        assert vector.shape == (8,)
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-12
        np.testing.assert_allclose(vector, _unit(np.asarray(item["embedding"][:8])), rtol=1e-12)


def test_base64_embeddings_truncated_and_renormalised() -> None:
    body = _fixture("llamacpp_embeddings_base64.json")
    floats = json.loads(_fixture("llamacpp_embeddings.json"))
    original = json.loads(body)
    out = json.loads(transform_embeddings(Prepared(b"", dimensions=16), body))
    assert out["usage"] == original["usage"] and out["model"] == original["model"]
    for got, item, as_float in zip(out["data"], original["data"], floats["data"], strict=True):
        assert got["encoding_format"] == "base64" and got["index"] == item["index"]
        vector = np.frombuffer(base64.b64decode(got["embedding"]), dtype="<f4")
        assert vector.shape == (16,)
        assert abs(float(np.linalg.norm(vector.astype(np.float64))) - 1.0) < 1e-6
        native = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert native.shape == (64,)
        # the base64 answer holds the same vectors as the float one
        np.testing.assert_allclose(native, as_float["embedding"], rtol=1e-6)
        expected = _unit(native[:16].astype(np.float64)).astype("<f4")
        np.testing.assert_array_equal(vector, expected)


def test_full_size_is_a_renormalised_copy_and_above_is_refused() -> None:
    body = _fixture("llamacpp_embeddings.json")
    out = json.loads(transform_embeddings(Prepared(b"", dimensions=64), body))
    np.testing.assert_allclose(
        out["data"][0]["embedding"], json.loads(body)["data"][0]["embedding"], rtol=1e-6
    )
    with pytest.raises(V1Error) as caught:
        transform_embeddings(Prepared(b"", dimensions=65), body)
    assert caught.value.status == 400 and caught.value.param == "dimensions"
    assert "64" in caught.value.message


def test_zero_vector_stays_zero() -> None:
    zero_b64 = base64.b64encode(np.zeros(6, dtype="<f4").tobytes()).decode()
    body = json.dumps(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": 0, "embedding": [0.0] * 6},
                {"object": "embedding", "index": 1, "embedding": zero_b64},
            ],
        }
    ).encode()
    out = json.loads(transform_embeddings(Prepared(b"", dimensions=3), body))
    assert out["data"][0]["embedding"] == [0.0, 0.0, 0.0]
    assert np.frombuffer(base64.b64decode(out["data"][1]["embedding"]), "<f4").tolist() == [0] * 3


def test_nothing_to_do_returns_the_same_bytes() -> None:
    body = _fixture("llamacpp_embeddings.json")
    assert transform_embeddings(Prepared(b""), body) is body
    error = b'{"error":{"code":400,"message":"x","type":"invalid_request_error"}}'
    assert transform_embeddings(Prepared(b"", dimensions=4), error) is error
    assert transform_embeddings(Prepared(b"", dimensions=4), b"not json") == b"not json"


# --- StreamFilter: the client asked for usage itself ----------------------------------------


@pytest.mark.parametrize(
    ("stream", "usage"),
    [
        (CHAT_USAGE, (67, 8)),
        (COMPLETION_PLAIN, (17, 8)),
        (COMPLETION_USAGE, (17, 8)),
        (CHAT_PLAIN, None),
    ],
)
def test_sniffing_passes_every_chunk_through_unchanged(
    stream: bytes, usage: tuple[int, int] | None
) -> None:
    for cut in range(len(stream) + 1):
        f = StreamFilter(injected_usage=False)
        first, second = stream[:cut], stream[cut:]
        assert f.feed(first) is first
        assert f.feed(second) is second
        assert f.close() == b""
        assert f.usage == usage, cut


def test_sniffing_byte_by_byte_and_crlf() -> None:
    crlf = CHAT_USAGE.replace(b"\n", b"\r\n")
    for stream in (CHAT_USAGE, crlf, CHAT_USAGE.replace(b"\n", b"\r")):
        out, f = _run(stream, list(range(1, len(stream))), injected=False)
        assert out == stream and f.usage == (67, 8)


def test_sniffing_reads_a_usage_event_cut_off_at_the_end() -> None:
    stream = CHAT_USAGE.replace(b"\n\ndata: [DONE]\n\n", b"")
    out, f = _run(stream, [len(stream) // 2], injected=False)
    assert out == stream and f.usage == (67, 8)


# --- StreamFilter: the router injected include_usage ---------------------------------------


def test_injected_chat_stream_is_what_the_client_would_have_seen() -> None:
    expected = _normalise(CHAT_PLAIN)
    whole, f = _run(CHAT_USAGE, [], injected=True)
    assert _normalise(whole) == expected
    assert f.usage == (67, 8)
    # the timings moved back are the engine's own bytes
    timings = re.search(rb',"timings":\{[^}]*\}', CHAT_USAGE)
    assert timings is not None and timings.group(0) in whole
    assert b'"usage"' not in whole and b'"choices":[]' not in whole
    for cut in range(len(CHAT_USAGE) + 1):
        out, f = _run(CHAT_USAGE, [cut], injected=True)
        assert out == whole, cut
        assert f.usage == (67, 8)


def test_injected_chat_stream_byte_by_byte_and_crlf() -> None:
    whole, _ = _run(CHAT_USAGE, [], injected=True)
    out, f = _run(CHAT_USAGE, list(range(1, len(CHAT_USAGE))), injected=True)
    assert out == whole and f.usage == (67, 8)
    crlf = CHAT_USAGE.replace(b"\n", b"\r\n")
    for cut in range(0, len(crlf) + 1, 7):
        out, f = _run(crlf, [cut, cut + 3], injected=True)
        assert out == whole.replace(b"\n", b"\r\n"), cut
        assert f.usage == (67, 8)


def test_injected_completion_stream_is_unchanged() -> None:
    # llama.cpp puts usage in the last /v1/completions chunk with or without the flag.
    assert _normalise(COMPLETION_USAGE) == _normalise(COMPLETION_PLAIN)
    for cut in range(len(COMPLETION_USAGE) + 1):
        out, f = _run(COMPLETION_USAGE, [cut], injected=True)
        assert out == COMPLETION_USAGE, cut
        assert f.usage == (17, 8)


def test_injected_content_events_go_out_at_once() -> None:
    f = StreamFilter(injected_usage=True)
    for chunk in EVENTS[:-4]:  # role and token chunks
        assert f.feed(chunk) == chunk
    # only an incomplete trailing event waits, and only until it is complete
    partial = EVENTS[-4]
    assert f.feed(partial[:10]) == b""
    assert f.feed(partial[10:]) == partial
    assert b'"finish_reason":"length"' in FINISH and b'"usage"' in USAGE_ONLY
    assert f.feed(FINISH) == b""  # held for the usage event right behind it
    released = f.feed(USAGE_ONLY)
    assert released.startswith(FINISH[:-3]) and b',"timings":{' in released
    assert released.endswith(b"}}\n\n") and json.loads(released[6:])["timings"]
    assert f.feed(DONE) == DONE
    assert f.close() == b"" and f.usage == (67, 8)


def test_held_finish_event_is_released_by_anything_else() -> None:
    finish = FINISH
    f = StreamFilter(injected_usage=True)
    assert f.feed(finish) == b""
    assert f.feed(b"data: [DONE]\n\n") == finish + b"data: [DONE]\n\n"
    f = StreamFilter(injected_usage=True)
    assert f.feed(finish) == b""
    assert f.close() == finish
    assert f.usage is None


def test_error_event_inside_the_stream_passes_unchanged() -> None:
    error = (
        b'data: {"error":{"code":500,"message":"Input prompt is too big","type":"server_error",'
        b'"usage":{"prompt_tokens":1}}}\n\n'
    )
    head, finish = EVENTS[0], FINISH
    for injected in (False, True):
        stream = head + error
        out, _ = _run(stream, [len(head) + 5], injected=injected)
        assert out == stream
        out, _ = _run(head + finish + error, [], injected=injected)
        assert out == head + finish + error  # the held finish chunk goes first
    bare = b'data: {"error":{"message":"x","type":"server_error","code":500}}'
    out, _ = _run(bare, [3], injected=True)  # cut off without its blank line
    assert out == bare


def test_usage_only_event_from_another_engine_is_dropped() -> None:
    # vLLM/OpenAI shape: usage-only event with choices [] and no llama.cpp timings.
    content = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    finish = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason": "stop"}]}\n\n'
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    stream = content + finish + usage + b"data: [DONE]\n\n"
    out, f = _run(stream, [len(content) + len(finish) + 4], injected=True)
    assert out == content + finish + b"data: [DONE]\n\n"
    assert f.usage == (3, 1)


def test_other_sse_fields_and_comments_pass() -> None:
    stream = b': ping\n\nevent: message\nid: 1\ndata: {"choices":[]}\n\nretry: 10\n\n'
    out, _ = _run(stream, [4, 20], injected=True)
    assert out == stream


def test_an_oversized_event_is_forwarded_without_waiting() -> None:
    big = b'data: {"choices":[{"delta":{"content":"' + b"x" * (MAX_EVENT + 10)
    rest = b'"},"finish_reason":null}]}\n\n'
    tail = FINISH + USAGE_ONLY + DONE
    f = StreamFilter(injected_usage=True)
    assert f.feed(big) == big
    assert f.feed(rest[:3]) == rest[:3]
    out = f.feed(rest[3:] + tail) + f.close()
    assert out.startswith(rest[3:]) and b'"usage"' not in out
    assert f.usage == (67, 8)
    f = StreamFilter(injected_usage=True)
    assert f.feed(FINISH) == b""
    assert f.feed(big) == FINISH + big  # order kept: the held chunk goes first
    assert f.feed(rest) == rest and f.close() == b""
    for injected in (False, True):
        stream = big + rest + tail
        out, f = _run(stream, [100, len(big) + 1, len(big) + len(rest) - 1], injected=injected)
        assert f.usage == (67, 8)
        if not injected:
            assert out == stream


def _coalesced_stream(tokens: int, newline: bytes = b"\n") -> bytes:
    """A long chat stream as the router gets it from a busy agent: many events per piece."""
    content = EVENTS[1:-3]
    body = b"".join(content[i % len(content)] for i in range(tokens))
    return (EVENTS[0] + body + FINISH + USAGE_ONLY + DONE).replace(b"\n", newline)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_a_coalesced_block_is_filtered_in_linear_time(newline: bytes) -> None:
    # 4,000 events in one block, the finish chunk and the usage event at its end (a
    # lagging router takes up to 256 KiB at once). Cutting such a block into events
    # used to search the rest of the block at every event: 2.8 s for this one block
    # (70 us per chunk on the router), against about 2 ms now.
    import time

    stream = _coalesced_stream(4000, newline)
    whole, f = _run(stream, [], injected=True)
    assert f.usage == (67, 8)
    assert b'"usage"' not in whole and whole.endswith(DONE.replace(b"\n", newline))
    for injected in (True, False):
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            out, g = _run(stream, [], injected=injected)
            best = min(best, time.perf_counter() - started)
        assert out == (whole if injected else stream) and g.usage == (67, 8)
        assert best < 0.25, f"{best:.3f} s for one block of {len(stream):,} bytes"


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_coalesced_pieces_cut_anywhere_keep_the_event_boundaries(newline: bytes) -> None:
    # The hops hand on whatever has arrived in one piece: several events, and a piece
    # may end inside an event (or inside its blank line). The filter sees the same
    # events whatever the cuts, and never holds back a complete content event.
    import random

    rng = random.Random(12)
    stream = _coalesced_stream(300, newline)
    whole, _ = _run(stream, [], injected=True)
    boundary = b"\n\n".replace(b"\n", newline)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(2, 40)))
        f = StreamFilter(injected_usage=True)
        sent = b""
        last = 0
        for cut in [*cuts, len(stream)]:
            sent += f.feed(stream[last:cut])
            received = stream[:cut]
            if b'"finish_reason":"' not in received:
                # Everything up to the last complete event went out with this piece.
                at = received.rfind(boundary)
                assert sent == (received[: at + len(boundary)] if at >= 0 else b""), cut
            last = cut
        sent += f.close()
        assert sent == whole, cuts
        assert f.usage == (67, 8)


# --- usage from JSON answers --------------------------------------------------------------------


def test_usage_from_shapes() -> None:
    assert usage_from({"usage": {"prompt_tokens": 3, "completion_tokens": 2}}) == (3, 2)
    assert usage_from({"usage": {"prompt_tokens": 5, "total_tokens": 5}}) == (5, 0)
    assert usage_from({"response": {"usage": {"input_tokens": 4, "output_tokens": 1}}}) == (4, 1)
    assert usage_from([{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}] * 2) == (2, 2)
    assert usage_from({"usage": {"prompt_tokens": True}}) is None
    assert usage_from({"usage": None}) is None and usage_from("x") is None


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("llamacpp_chat.json", (67, 8)),
        ("llamacpp_embeddings.json", (44, 0)),
        ("llamacpp_embeddings_base64.json", (44, 0)),
    ],
)
def test_usage_sniffer_on_real_answers(name: str, usage: tuple[int, int]) -> None:
    body = _fixture(name)
    if name == "llamacpp_chat.json":
        # a long answer: usage sits about 400 bytes before the end, behind the content
        body = body.replace(b'"content":"', b'"content":"' + b"word " * 20_000)
    else:
        # a big batch: usage sits before the data
        body = body.replace(b'"data":[', b'"data":[' + b'{"embedding":[0.5],"index":9},' * 5000)
    assert len(body) > 2 * 16 * 1024  # so the search, not the full parse, answers
    for limit in (16 * 1024, 1024):
        for step in (1000, 4096, len(body)):
            sniffer = UsageSniffer(limit=limit)
            for i in range(0, len(body), step):
                sniffer.feed(body[i : i + step])
            assert sniffer.usage == usage, (limit, step)
    sniffer = UsageSniffer()
    sniffer.feed(_fixture(name))  # small: parsed whole
    assert sniffer.usage == usage


def test_usage_sniffer_keeps_references_not_copies() -> None:
    head = b'{"object":"list","data":[' + b"1.0," * 200_000
    big = b"2.0," * 1_000_000
    end = b'3.0],"usage":{"prompt_tokens":12,"completion_tokens":0}}'
    sniffer = UsageSniffer()
    for chunk in (head, big, big, end):
        sniffer.feed(chunk)
    assert all(
        any(kept is chunk for chunk in (head, big, end)) for kept in sniffer._head + sniffer._tail
    )
    assert sniffer._head == [head] and len(sniffer._tail) <= 2
    assert sniffer.usage == (12, 0)


def test_usage_sniffer_ignores_a_string_value_and_escaped_text() -> None:
    body = (
        b'{"choices":[{"message":{"content":"say \\"usage\\":{\\"prompt_tokens\\":9}"}}],'
        b'"usage":{"prompt_tokens":2,"completion_tokens":1},"object":"usage"}'
    )
    assert json.loads(body)["usage"] == {"prompt_tokens": 2, "completion_tokens": 1}
    for padding in (b"", b" " * 300):  # parsed whole; searched in a 160-byte tail
        sniffer = UsageSniffer(limit=160)
        sniffer.feed(padding + body)
        assert sniffer.usage == (2, 1)
    sniffer = UsageSniffer(limit=16)
    sniffer.feed(b'{"content":"say \\"usage\\":{\\"prompt_tokens\\":9}"}' + b" " * 40)
    assert sniffer.usage is None
    sniffer = UsageSniffer()
    sniffer.feed(b"no json here")
    assert sniffer.usage is None


def test_usage_sniffer_sums_a_list_and_reads_odd_spelling() -> None:
    one = json.loads(_fixture("llamacpp_chat.json"))
    sniffer = UsageSniffer()
    sniffer.feed(json.dumps([one, one]).encode())
    assert sniffer.usage == (134, 16)
    sniffer = UsageSniffer()
    sniffer.feed(json.dumps(one, indent=2).encode())  # "usage": {\n ... pretty-printed
    assert sniffer.usage == (67, 8)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_random_cuts_give_the_same_stream(newline: bytes) -> None:
    import random

    rng = random.Random(5)
    error = b'data: {"error":{"code":500,"message":"x","type":"server_error"}}\n\n'
    big = b'data: {"choices":[{"delta":{"content":"' + b"y" * (MAX_EVENT + 1) + b'"}}]}\n\n'
    streams = [CHAT_USAGE, COMPLETION_USAGE, EVENTS[0] + big + FINISH + USAGE_ONLY + error]
    for stream in (s.replace(b"\n", newline) for s in streams):
        whole, first = _run(stream, [], injected=True)
        sniffed, _ = _run(stream, [], injected=False)
        assert sniffed == stream
        for _ in range(60):
            cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
            out, f = _run(stream, cuts, injected=True)
            assert out == whole, cuts
            assert f.usage == first.usage
            out, g = _run(stream, cuts, injected=False)
            assert out == stream and g.usage == first.usage
    assert _normalise(_run(CHAT_USAGE.replace(b"\n", b"\r"), [], injected=True)[0]) == (
        _normalise(CHAT_PLAIN.replace(b"\n", b"\r"))
    )
