"""Content negotiation for the /api downloads (CSV): any Accept gets the file."""

from __future__ import annotations

from collections.abc import Iterable

from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request

__all__ = ["AnyAccept"]


class AnyAccept(DefaultContentNegotiation):
    """A CSV download is asked for with any Accept; errors still come back as JSON."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        first = next(iter(renderers))
        return first, first.media_type
