"""The console's page links: a list's filters stay in every link, only ``page`` changes
(core.paging.PAGE_SIZE rows a page), so a filtered page's URL can be shared."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.http import QueryDict

from core import paging

# Page numbers shown around the current one (then the first and the last).
AROUND = 3


def links(params: QueryDict, page: paging.Page, count: int) -> dict[str, Any]:
    """What pager.html prints: the range shown, previous, next and numbered links."""

    def url(number: int) -> str:
        kept = [(k, v) for k, values in params.lists() if k != "page" for v in values if v]
        return "?" + urlencode([*kept, *([("page", str(number))] if number > 1 else [])])

    numbers = sorted(
        {
            1,
            page.pages,
            *range(max(1, page.number - AROUND), min(page.pages, page.number + AROUND) + 1),
        }
    )
    shown: list[dict[str, Any]] = []
    last = 0
    for number in numbers:
        if number > last + 1:
            shown.append({"gap": True})
        shown.append({"number": number, "url": url(number), "current": number == page.number})
        last = number
    start = page.window.offset
    return {
        "first_row": start + 1 if count else 0,
        "last_row": min(count, start + paging.PAGE_SIZE),
        "count": count,
        "number": page.number,
        "pages": page.pages,
        "previous": url(page.number - 1) if page.number > 1 else "",
        "next": url(page.number + 1) if page.number < page.pages else "",
        "links": shown if page.pages > 1 else [],
    }
