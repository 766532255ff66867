"""The Audit page: who did what to the fleet, from where, filtered and exported as CSV.

Filters and paging are nodes.audit's rule, shared with /api/audit; the export link
points at /api/audit.csv with the same filters (the console's session is enough there).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from console.access import operator_required
from core.errors import ServiceError
from nodes import audit
from nodes.api.audit import csv_url

_FIELDS = ("action", "actor", "node", "from", "to")


def _detail(detail: dict[str, Any]) -> str:
    return json.dumps(detail, sort_keys=True, separators=(", ", ": ")) if detail else ""


@operator_required
@require_GET
def audit_page(request: HttpRequest) -> HttpResponse:
    """A page of events, newest first, with filters, the next page and the CSV link."""
    values = {name: str(request.GET.get(name, ""))[:150] for name in _FIELDS}
    context: dict[str, Any] = {"values": values, "events": [], "csv_url": csv_url(values)}
    try:
        events, after = audit.page(audit.parse_filter(request.GET))
    except ServiceError as exc:
        context["error"] = exc.message
        return render(request, "console/audit.html", context, status=exc.status)
    context["events"] = [(event, _detail(event.detail)) for event in events]
    if after is not None:
        kept = {k: v for k, v in values.items() if v}
        context["next_url"] = "?" + urlencode({**kept, "before": after})
    return render(request, "console/audit.html", context)
