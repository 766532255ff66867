"""Query parameters of the fleet's lists: filter values and the page window.

``GET /api/nodes``, ``GET /api/models`` and the console's Nodes and Models pages read
their filters and pages here, so a bad value gets one wording everywhere: a 400
``invalid_request`` naming the parameter and what it takes (docs/operator-guide.md,
"Node and model lists"). Without ``limit`` an API list answers every matching row up to
``UNPAGED_MAX`` (docs/decisions.md (Lists of a thousand nodes: all rows up to a cap)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from core.errors import ServiceError

T = TypeVar("T")

# An API list without ``limit`` answers at most this many rows (then ``next`` says where
# the rest starts): a thousand-node fleet's lists fit whole, a runaway one cannot make a
# response of unbounded size.
UNPAGED_MAX = 5000
LIMIT_MAX = 1000
# A filter naming more values than this is refused (each is matched against every row).
VALUES_MAX = 50
TEXT_MAX = 200
# The console's pages: rows per page.
PAGE_SIZE = 200


def refuse(name: str, what: str) -> ServiceError:
    """The 400 of a bad query parameter, naming it (``details.field``) and what it takes."""
    return ServiceError(400, "invalid_request", f"{name}: {what}", details={"field": name})


def _raw(params: Any, name: str) -> list[str]:
    getlist = getattr(params, "getlist", None)
    if getlist is not None:
        return [str(v) for v in getlist(name)]
    value = params.get(name)
    return [] if value is None else [str(value)]


def text(params: Any, name: str, *, most: int = TEXT_MAX) -> str:
    """One text value, stripped ("" when absent); longer than ``most`` is a 400."""
    values = _raw(params, name)
    value = values[-1].strip() if values else ""
    if len(value) > most:
        raise refuse(name, f"at most {most} characters")
    return value


def strings(params: Any, name: str, *, most: int = TEXT_MAX) -> list[str]:
    """A parameter that may repeat: its non-empty values, stripped; more than
    :data:`VALUES_MAX` of them, or one longer than ``most``, is a 400."""
    values = [v.strip() for v in _raw(params, name) if v.strip()]
    if len(values) > VALUES_MAX:
        raise refuse(name, f"at most {VALUES_MAX} values")
    if any(len(v) > most for v in values):
        raise refuse(name, f"at most {most} characters each")
    return values


def choices(params: Any, name: str, allowed: Sequence[str]) -> frozenset[str]:
    """A filter that may repeat and take comma lists (``state=Online,Degraded&state=Offline``);
    each value one of ``allowed`` (case-insensitive), answered as ``allowed`` spells it."""
    by_lower = {a.lower(): a for a in allowed}
    values = [v.strip() for raw in _raw(params, name) for v in raw.split(",") if v.strip()]
    if len(values) > VALUES_MAX:
        raise refuse(name, f"at most {VALUES_MAX} values")
    found = set()
    for value in values:
        known = by_lower.get(value.lower())
        if known is None:
            raise refuse(name, f"one of {', '.join(allowed)}; not {value[:40]!r}")
        found.add(known)
    return frozenset(found)


def _whole(params: Any, name: str, lowest: int, highest: int) -> int | None:
    value = text(params, name, most=12)
    if not value:
        return None
    if not value.isdigit() or not lowest <= int(value) <= highest:
        raise refuse(name, f"a whole number from {lowest} to {highest}")
    return int(value)


@dataclass(frozen=True, slots=True)
class Window:
    """Which rows of the matching ones to answer: ``offset`` first, at most ``limit``."""

    offset: int = 0
    limit: int = UNPAGED_MAX
    asked: bool = False  # whether the reader gave ``limit`` (the answer says so)

    def cut(self, rows: Sequence[T]) -> list[T]:
        return list(rows[self.offset : self.offset + self.limit])

    def next_offset(self, count: int) -> int | None:
        """Where the next page starts; None when this one reaches the last row."""
        end = self.offset + self.limit
        return end if end < count else None


def window(params: Any) -> Window:
    """``limit`` (1 to ``LIMIT_MAX``; left out: every row up to ``UNPAGED_MAX``) and
    ``offset`` (0 or more) of an API list."""
    limit = _whole(params, "limit", 1, LIMIT_MAX)
    offset = _whole(params, "offset", 0, 10**9) or 0
    if limit is None:
        return Window(offset=offset, limit=UNPAGED_MAX, asked=False)
    return Window(offset=offset, limit=limit, asked=True)


@dataclass(frozen=True, slots=True)
class Page:
    """A console page of ``PAGE_SIZE`` rows: its number (from 1) and how many there are."""

    number: int
    pages: int

    @property
    def window(self) -> Window:
        return Window(offset=(self.number - 1) * PAGE_SIZE, limit=PAGE_SIZE, asked=True)


def page_number(params: Any) -> int:
    """The console's ``page`` (from 1; left out: 1); not a whole number is a 400."""
    return _whole(params, "page", 1, 10**6) or 1


def console_page(number: int, count: int) -> Page:
    """The page to show of ``count`` rows: ``number``, or the last page past the end."""
    pages = max(1, -(-count // PAGE_SIZE))
    return Page(number=min(number, pages), pages=pages)
