"""JSON from clients: what parsing it can raise, and strings no database can hold.

One place for both ``/v1`` (router/app.py, router/transform.py) and ``/api``
(core/api_parsers.py), so that a body is refused the same way on either.
"""

from __future__ import annotations

from typing import Any

# What json.loads raises on bytes from outside: not JSON, not UTF-8, or nested deeper
# than the interpreter's recursion limit. 100,000 brackets raise RecursionError: the C
# scanner checks its depth as it descends, so this is the parser refusing, not a bug.
JSON_ERRORS = (ValueError, UnicodeDecodeError, RecursionError)


def why_not_json(exc: BaseException) -> str:
    """A client's reading of a JSON_ERRORS exception."""
    if isinstance(exc, RecursionError):
        return "it nests arrays or objects too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8"
    return str(exc)


# What a reader is told when a string is not text (lone surrogate or NUL).
NOT_TEXT = "must be text: no lone surrogate escape (\\ud800) and no NUL (\\u0000)"


def is_text(value: str) -> bool:
    """Whether ``value`` is text a database can hold: a JSON ``\\ud800`` escape decodes to
    a str that is not UTF-8, and PostgreSQL refuses a NUL in any text column."""
    if "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def first_non_text(data: Any) -> str | None:
    """The path (``a.b[2]``) of the first key or string in ``data`` that is not text, or None.

    Iterative: parsed JSON can be nested almost as deep as the recursion limit.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not is_text(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not is_text(key):
                    return (path + "." if path else "") + "(a member name)"
                stack.append((name, item))
        elif isinstance(value, list):
            for index in reversed(range(len(value))):
                stack.append((f"{path}[{index}]", value[index]))
    return None
