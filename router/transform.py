"""Request and response transforms of the /v1 router (docs/operator-guide.md, "/v1", issue 5).

The router is a byte pass-through; this module holds the few places where it is not,
each written so that the untouched case costs next to nothing and returns the very
same ``bytes`` object it was given.

* ``prepare`` decides, per request, what goes upstream. Two rewrites exist:

  - a streamed ``/v1/chat/completions`` or ``/v1/completions`` without
    ``stream_options.include_usage: true`` gets it added, so the engine reports the
    token usage the router meters (``injected_usage``);
  - an ``/v1/embeddings`` request with ``dimensions`` for a model with "emulate
    dimensions" on loses the field (llama-server ignores it and returns every value)
    and the answer is truncated and renormalised by ``transform_embeddings``.

  Everything else is forwarded byte for byte.

* ``StreamFilter`` (router/sse.py) forwards server-sent events as they arrive, reads the usage from
  them and, when the router injected ``include_usage``, removes what the injection
  added, so the client receives what it would have received without it.
* ``UsageSniffer`` (router/sse.py) reads the usage of a non-streamed JSON answer from a bounded head
  and tail, without copying the body.

What llama-server sends (captured from the real llama-server 0.6.0-dev with a tiny
GGUF, tests/router/fixtures/llamacpp_*.txt):

* ``/v1/chat/completions`` streamed, without ``include_usage``: a role chunk, one
  chunk per token, a finish chunk (``"finish_reason":"length"``, ``"delta":{}``) that
  carries llama.cpp's ``"timings"`` as its last member, then ``data: [DONE]``. No
  ``usage`` anywhere.
* the same with ``include_usage: true``: the finish chunk comes *without*
  ``timings``, followed by one extra event ``{"choices":[], ..., "usage":{...},
  "timings":{...}}`` and ``[DONE]``. So when the router injected the flag, the filter
  holds the finish chunk until that extra event (they leave llama-server in one
  write), drops the extra event and moves its ``timings`` member back onto the
  finish chunk, byte for byte. The client's stream is then exactly the one it would
  have had.
* ``/v1/completions`` streamed: the last content chunk (with ``finish_reason``)
  carries ``usage`` and ``timings`` *whether or not* ``include_usage`` is set; the
  flag changes nothing. The filter therefore never removes a ``usage`` from a
  content chunk: the client would have received it anyway.
* an error after the stream started is one event ``data: {"error":{...}}`` and the
  stream ends (llama.cpp's server source); an error before the first token is an
  ordinary non-streamed JSON answer with its HTTP status. Both pass unchanged.
* events end in ``\\n\\n``; the filter also accepts ``\\r\\n\\r\\n`` and ``\\r\\r``.

Non-streamed answers carry ``usage`` near the end for chat and completions, but near
the start (before ``data``) for embeddings, hence the sniffer's head and tail.

Wiring (router/app.py): call ``prepare`` with the dict the router parsed to find
``model``; send ``prepared.body``. On a 2xx ``text/event-stream`` answer, pass each
upstream chunk through ``StreamFilter(injected_usage=prepared.injected_usage).feed``
and send what it returns when non-empty, then ``close()``; read ``.usage`` at the
end. On any other answer, feed a ``UsageSniffer`` alongside the unchanged chunks.
When ``prepared.dimensions`` is set and the answer is 2xx, read the whole body,
send ``transform_embeddings(prepared, body)`` with a new content-length (a V1Error it
raises is the client's 400).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.jsoninput import JSON_ERRORS
from router.errors import V1Error

__all__ = [
    "Prepared",
    "check_dimensions",
    "prepare",
    "transform_embeddings",
    "with_model",
]

STREAMED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
EMBEDDINGS_PATH = "/v1/embeddings"

# What is spliced in before the body's closing brace when the client sent no
# stream_options at all: the common case, and one copy of the body instead of a
# parse-and-serialise round trip that could change how numbers or strings are spelled.
_INCLUDE_USAGE_MEMBER = b',"stream_options":{"include_usage":true}'


@dataclass(frozen=True, slots=True)
class Prepared:
    """What to send upstream, and what the answer's handling needs to know.

    ``body`` is the request body to forward: the very object passed to ``prepare``
    unless it was rewritten. ``dimensions`` is set only when the router emulates them
    (then the answer must go through ``transform_embeddings``). ``injected_usage``
    means the router added ``include_usage`` and the stream must go through a
    ``StreamFilter(injected_usage=True)``.
    """

    body: bytes
    dimensions: int | None = None
    encoding_format: str | None = None
    stream: bool = False
    injected_usage: bool = False


def _invalid_dimensions(message: str) -> V1Error:
    # vLLM answers a bad dimensions with 400 and type invalid_request_error; the
    # OpenAI shape of errors.py gives that type to every 4xx.
    return V1Error(400, "invalid_request_error", message, param="dimensions")


def check_dimensions(value: Any, native_dimensions: int | None = None) -> int:
    """``value`` as a valid dimensions, else a 400 V1Error with param ``dimensions``.

    Only a JSON integer counts: ``true``, ``1.5``, ``3.0`` and ``"3"`` are refused.
    """
    if type(value) is not int:  # bool is an int subclass, and is refused
        raise _invalid_dimensions(f"dimensions must be an integer, got {json.dumps(value)[:40]}.")
    if value < 1:
        raise _invalid_dimensions("Dimensions must be greater than 0")
    if native_dimensions is not None and value > native_dimensions:
        raise _invalid_dimensions(
            f"dimensions {value} is larger than the model's {native_dimensions} dimensions."
        )
    return value


def prepare(
    path: str,
    body: bytes,
    *,
    emulate_dimensions: bool,
    data: dict[str, Any] | None = None,
    native_dimensions: int | None = None,
) -> Prepared:
    """Decide what to forward for ``path``; ``data`` is ``body`` already parsed, if it is.

    Raises V1Error 400 for a ``dimensions`` that cannot be emulated. A body that is
    not a JSON object is forwarded unchanged: refusing it is the router's job.
    """
    if path in STREAMED_PATHS:
        if data is None:
            if b'"stream"' not in body:
                return Prepared(body)  # cannot be streamed: no parse needed
            data = _parse(body)
            if data is None:
                return Prepared(body)
        if data.get("stream") is not True:  # llama.cpp reads only a JSON true
            return Prepared(body)
        options = data.get("stream_options")
        if options is None and "stream_options" not in data:
            return Prepared(_splice_include_usage(body, data), stream=True, injected_usage=True)
        if isinstance(options, dict) and options.get("include_usage") is True:
            return Prepared(body, stream=True)
        if options is not None and not isinstance(options, dict):
            # Not ours to repair: the engine answers it as it would without the router.
            return Prepared(body, stream=True)
        rewritten = dict(data)
        rewritten["stream_options"] = {**(options or {}), "include_usage": True}
        return Prepared(_dumps(rewritten), stream=True, injected_usage=True)

    if path == EMBEDDINGS_PATH and emulate_dimensions:
        if data is None:
            if b'"dimensions"' not in body:
                return Prepared(body)
            data = _parse(body)
            if data is None:
                return Prepared(body)
        if data.get("dimensions") is None:
            # Absent (or null, which every engine reads as absent): byte for byte.
            return Prepared(body)
        dimensions = check_dimensions(data["dimensions"], native_dimensions)
        fmt = data.get("encoding_format")
        rewritten = {k: v for k, v in data.items() if k != "dimensions"}
        return Prepared(
            _dumps(rewritten),
            dimensions=dimensions,
            encoding_format=fmt if isinstance(fmt, str) else None,
        )

    return Prepared(body)


def with_model(data: dict[str, Any], model: str) -> tuple[bytes, dict[str, Any]]:
    """The request re-addressed to ``model``, as a body and its dict, for ``prepare``.

    Only for a client that called a route (an alias): its target is served under its
    own name, and vLLM refuses a ``model`` it does not serve. A client calling a served
    name never comes here, so its body stays byte for byte.
    """
    rewritten = dict(data)
    rewritten["model"] = model
    return _dumps(rewritten), rewritten


def _parse(body: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except JSON_ERRORS:
        return None
    return data if isinstance(data, dict) else None


def _dumps(data: Any) -> bytes:
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A lone surrogate (legal as a JSON \\ud800 escape) cannot be UTF-8: keep it escaped.
        return json.dumps(data, separators=(",", ":")).encode()


def _splice_include_usage(body: bytes, data: dict[str, Any]) -> bytes:
    end = len(body)
    while end and body[end - 1] in b" \t\r\n":
        end -= 1
    start = 0
    while start < end and body[start] in b" \t\r\n":
        start += 1
    # Only a plain UTF-8 object "{...}" with members is spliced; a BOM, UTF-16 or an
    # empty object goes the safe (re-serialised) way.
    if not data or end - start < 2 or body[start] != 0x7B or body[end - 1] != 0x7D:
        rewritten = dict(data)
        rewritten["stream_options"] = {"include_usage": True}
        return _dumps(rewritten)
    return body[: end - 1] + _INCLUDE_USAGE_MEMBER + body[end - 1 :]


# --- embeddings ---------------------------------------------------------------------


def transform_embeddings(prepared: Prepared, body: bytes) -> bytes:
    """Truncate each embedding of a 2xx answer to ``prepared.dimensions`` and L2-renormalise.

    Float lists and ``base64`` (little-endian float32) are both handled, per item, by
    what the item holds. Every other member is kept as is. Returns ``body`` itself when
    there is nothing to do (no emulation, or not an embeddings list, e.g. an error).
    Raises V1Error 400 when ``dimensions`` is above the native size, which only the
    answer tells.
    """
    n = prepared.dimensions
    if n is None:
        return body
    try:
        doc = json.loads(body)
    except JSON_ERRORS:
        return body
    items = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        return body
    for item in items:
        if not isinstance(item, dict):
            continue
        embedding = item.get("embedding")
        if isinstance(embedding, str):
            raw = np.frombuffer(base64.b64decode(embedding), dtype="<f4")
            cut = _truncate(raw, n)
            item["embedding"] = base64.b64encode(cut.astype("<f4").tobytes()).decode("ascii")
        elif isinstance(embedding, list):
            item["embedding"] = _truncate(np.asarray(embedding, dtype=np.float64), n).tolist()
    return _dumps(doc)


def _truncate(values: np.ndarray, n: int) -> np.ndarray:
    native = values.shape[-1] if values.ndim else 0
    if n > native:
        raise _invalid_dimensions(f"dimensions {n} is larger than the model's {native} dimensions.")
    # float64 for the norm: the renormalised float32 values are then exactly rounded.
    cut = np.asarray(values[..., :n], dtype=np.float64)
    norm = np.linalg.norm(cut, axis=-1, keepdims=True)
    out = np.zeros_like(cut)
    np.divide(cut, norm, out=out, where=norm > 0)  # a zero vector stays zero
    return out


# --- usage ----------------------------------------------------------------------------
