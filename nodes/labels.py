"""Node labels: the operator's own ``key=value`` tags on a node, to find and group nodes.

A node has at most :data:`MAX_LABELS` labels. A key is 1 to 63 characters of lowercase
letters, digits, ``.``, ``-``, ``_`` and ``/``, starting and ending with a letter or a
digit (``gpu``, ``zone``, ``team/owner``); a value is empty or 1 to 63 characters of
letters, digits, ``.``, ``-`` and ``_``, starting and ending with a letter or a digit
(``a100``, ``eu-west-1``). Both are allow-listed: they reach URLs, filters and pages.
The lists filter with ``label=key`` (the node has the key) or ``label=key=value``;
several (repeated, or one parameter with commas or spaces between them) must all hold (docs/operator-guide.md, "Node labels").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from core import paging
from core.errors import ServiceError
from nodes import audit
from nodes.models import Node

MAX_LABELS = 32
KEY = re.compile(r"[a-z0-9](?:[a-z0-9._/-]{0,61}[a-z0-9])?")
VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
KEY_RULE = "1 to 63 of a-z 0-9 . - _ /, starting and ending with a letter or digit"
VALUE_RULE = "empty or 1 to 63 of A-Z a-z 0-9 . - _, starting and ending with a letter or digit"

Selector = tuple[str, str | None]  # (key, value); None: any value
_SEPARATORS = re.compile(r"[\s,]+")  # one parameter may hold several: "gpu=a100,zone=eu"


def clean(labels: object) -> dict[str, str]:
    """``labels`` checked: a JSON object of at most :data:`MAX_LABELS` keys to strings,
    each key and value allowed; anything else is a 400 naming what is wrong."""
    if not isinstance(labels, dict):
        raise _refuse('labels: must be an object of key to value, e.g. {"gpu": "a100"}')
    if len(labels) > MAX_LABELS:
        raise _refuse(f"labels: at most {MAX_LABELS} per node; got {len(labels)}")
    for key, value in labels.items():
        if not isinstance(key, str) or KEY.fullmatch(key) is None:
            raise _refuse(f"labels: key {str(key)[:80]!r} is not allowed: {KEY_RULE}")
        if not isinstance(value, str) or VALUE.fullmatch(value) is None:
            shown = value[:80] if isinstance(value, str) else type(value).__name__
            raise _refuse(f"labels.{key}: value {shown!r} is not allowed: {VALUE_RULE}")
    return dict(sorted(labels.items()))


def _refuse(message: str) -> ServiceError:
    return ServiceError(400, "invalid_request", message, details={"field": "labels"})


def set_labels(node_id: str, labels: object) -> Node:
    """Replace the node's labels with ``labels`` (an empty object removes them all)."""
    cleaned = clean(labels)
    node = Node.objects.filter(node_id=node_id).first()
    if node is None:
        raise ServiceError(404, "not_found", f"Node '{node_id}' does not exist.")
    if cleaned != (node.labels or {}):
        before = node.labels or {}
        node.labels = cleaned
        node.save(update_fields=["labels", "updated_at"])
        audit.record("node.labels_changed", node_id=node_id, before=before, after=cleaned)
    return node


def parse_selectors(params: Any, name: str = "label") -> tuple[Selector, ...]:
    """The ``label`` filters of a list: each ``key`` or ``key=value``, repeatable or
    separated by commas or spaces; a bad one is a 400 naming the parameter
    (core.paging)."""
    raw = [part for value in paging.strings(params, name) for part in _SEPARATORS.split(value)]
    if len(raw) > paging.VALUES_MAX:
        raise paging.refuse(name, f"at most {paging.VALUES_MAX} labels")
    found: list[Selector] = []
    for text in filter(None, raw):
        key, equals, value = text.partition("=")
        if KEY.fullmatch(key) is None:
            raise paging.refuse(name, f"key or key=value, the key {KEY_RULE}; not {text[:60]!r}")
        if equals and VALUE.fullmatch(value) is None:
            raise paging.refuse(name, f"the value after '=' is {VALUE_RULE}; not {text[:60]!r}")
        found.append((key, value if equals else None))
    return tuple(found)


def matches(labels: Mapping[str, str] | None, selectors: tuple[Selector, ...]) -> bool:
    """Whether a node's ``labels`` satisfy every selector."""
    have = labels or {}
    return all(key in have and (value is None or have[key] == value) for key, value in selectors)


def text(labels: Mapping[str, str] | None) -> str:
    """``key=value`` pairs as the console shows them (``key`` alone for an empty value)."""
    return " ".join(f"{k}={v}" if v else k for k, v in sorted((labels or {}).items()))
