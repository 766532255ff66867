"""Names both sides check the same way: node ids, instance ids and model folders.

Each rule is one pattern matched with ``fullmatch`` (a ``$`` anchor with ``re.match``
would let a trailing newline through). The checks return a sentence naming what is
wrong, or raise :class:`NameRefused` (a ValueError); each side turns that into its own
answer (the agent's 400 invalid_request, the master's API error).
"""

from __future__ import annotations

import re

__all__ = [
    "FOLDER_PATTERN",
    "FOLDER_RE",
    "INSTANCE_ID_PATTERN",
    "INSTANCE_ID_RE",
    "NODE_ID_PATTERN",
    "NODE_ID_RE",
    "NameRefused",
    "check_folder_name",
    "node_id_problem",
]

# A node id is also a DNS label and a path segment: lower case, digits, '-'.
NODE_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
NODE_ID_RE = re.compile(NODE_ID_PATTERN)
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
INSTANCE_ID_RE = re.compile(INSTANCE_ID_PATTERN)
FOLDER_PATTERN = r"^[A-Za-z0-9._-]{1,200}$"
FOLDER_RE = re.compile(FOLDER_PATTERN)


class NameRefused(ValueError):
    """A name broke its rule; the message names the field and the rule."""


def node_id_problem(value: object) -> str | None:
    """None when ``value`` is a valid node id, else what is wrong with it."""
    if isinstance(value, str) and NODE_ID_RE.fullmatch(value):
        return None
    return (
        f"{value!r} is not a valid node id; use 1 to 40 lower-case letters, digits and "
        "'-', starting with a letter or digit"
    )


def check_folder_name(folder: object, field: str = "folder") -> str:
    """``folder`` if it is a valid model folder name, else NameRefused naming ``field``.

    ``^[A-Za-z0-9._-]{1,200}$`` and not ``.`` or ``..`` (both match the character class,
    and both name a directory that is not a model folder).
    """
    if not isinstance(folder, str) or not FOLDER_RE.fullmatch(folder) or folder in (".", ".."):
        raise NameRefused(
            f"{field} {folder!r} must match ^[A-Za-z0-9._-]{{1,200}}$ and not be . or .."
        )
    return folder
