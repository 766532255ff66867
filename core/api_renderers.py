"""The API's JSON renderer: DRF's answers, encoded by orjson.

A list of 1,000 nodes is a few megabytes of JSON; the standard library took 45-60 ms to
encode it, orjson about 5 (docs/performance.md, "A fleet of a thousand machines"). The
answer is the same JSON as DRF's renderer writes: dates, times, decimals and the rest go
through DRF's own encoder, U+2028 and U+2029 are escaped as DRF does, and whatever orjson
refuses (a key that is not a string, an integer past 64 bits) or an indented answer
asked for in the Accept header is left to DRF's renderer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from rest_framework.renderers import JSONRenderer

_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


class FastJSONRenderer(JSONRenderer):
    """``application/json`` as DRF's ``JSONRenderer`` writes it, faster."""

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Mapping[str, Any] | None = None,
    ) -> bytes:
        if data is None:
            return b""
        if self.get_indent(accepted_media_type or "", renderer_context or {}) is None:
            try:
                out = orjson.dumps(data, default=self.encoder_class().default, option=_OPTIONS)
            except orjson.JSONEncodeError:
                pass  # DRF's renderer: the same JSON, or the same error
            else:
                if b"\xe2\x80" not in out:  # one scan, not two: most answers have neither
                    return out
                return out.replace(b"\xe2\x80\xa8", b"\\u2028").replace(b"\xe2\x80\xa9", b"\\u2029")
        return super().render(data, accepted_media_type, renderer_context)
