"""Names both sides check the same way: node ids, instance ids, folders and file names.

Each rule is one pattern matched with ``fullmatch`` (a ``$`` anchor with ``re.match``
would let a trailing newline through). The checks return a sentence naming what is
wrong, or raise :class:`NameRefused` (a ValueError); each side turns that into its own
answer (the agent's 400 invalid_request, the master's API error).

A name that becomes part of a path (a model folder, a model file, a file a download
writes) is checked by one rule, :func:`path_name_problem`, the same on every platform:
an agent may run on Windows, where ``C:``, ``\\\\server\\share``, ``name:stream``,
``CON`` or ``model.`` mean something else than on Linux. So the characters are an
allow-list (letters, digits, ``.``, ``_``, ``-``: no separator, drive colon, NUL or
space can get in), and the few names built of those characters that Windows reads
otherwise are refused too: ``.`` and ``..``, a trailing dot (Windows drops it, so
``model.`` is ``model``), and the device names (``CON``, ``PRN``, ``AUX``, ``NUL``,
``COM0``-``COM9``, ``LPT0``-``LPT9``, in any case, with or without an extension).
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
    "check_file_name",
    "check_folder_name",
    "check_relative_path",
    "is_device_name",
    "node_id_problem",
    "path_name_problem",
]

# A node id is also a DNS label and a path segment: lower case, digits, '-'.
NODE_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
NODE_ID_RE = re.compile(NODE_ID_PATTERN)
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
INSTANCE_ID_RE = re.compile(INSTANCE_ID_PATTERN)
# The characters of a model folder; check_folder_name adds the rest of the path rule.
FOLDER_PATTERN = r"^[A-Za-z0-9._-]{1,200}$"
FOLDER_RE = re.compile(FOLDER_PATTERN)
FOLDER_MAX = 200
# One path component: most file systems stop at 255 bytes (ASCII here, so characters).
FILE_NAME_MAX = 255
# A relative path of several components (a file of a Hugging Face repo): Windows'
# classic MAX_PATH is 260 for the whole path, but a models root on a long path is the
# operator's affair; this bounds what a request can make the agent build.
RELATIVE_PATH_MAX = 1000
RELATIVE_PATH_DEPTH = 16
_PATH_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
# Windows' device names: the part before the first dot, in any case ("nul.tar.gz" is NUL).
_DEVICE_RE = re.compile(r"(?:CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])", re.IGNORECASE)
_NAME_RULE = "letters, digits, '.', '_' and '-'"


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


def path_name_problem(name: object, max_len: int = FILE_NAME_MAX) -> str | None:
    """None when ``name`` is one safe path component on every platform, else why not.

    The rule of the module docstring: 1 to ``max_len`` of ``[A-Za-z0-9._-]``, not ``.``
    or ``..``, no trailing dot, not a Windows device name with or without extension.
    The answer starts with the pattern, then says which part of the rule is broken.
    """
    rule = f"must match ^[A-Za-z0-9._-]{{1,{max_len}}}$"
    if not isinstance(name, str) or not name or len(name) > max_len:
        return f"{rule} ({_NAME_RULE}, 1 to {max_len} of them)"
    if not _PATH_NAME_RE.fullmatch(name):
        return f"{rule} ({_NAME_RULE}: no path separator, colon, space or NUL)"
    if name in (".", ".."):
        return f"{rule} and not be . or .. (they name a directory, not an entry of it)"
    if name.endswith("."):
        return f"{rule} and not end with '.' (Windows drops a trailing dot: another name)"
    if is_device_name(name):
        return (
            f"{rule} and not be a Windows device name (CON, PRN, AUX, NUL, COM0-9, LPT0-9, "
            "with or without an extension)"
        )
    return None


def is_device_name(name: str) -> bool:
    """Whether Windows reads ``name`` as a device (``CON``, ``nul.tar.gz``, ``com1``...)."""
    return _DEVICE_RE.fullmatch(name.split(".", 1)[0]) is not None


def _shown(value: object) -> str:
    """``value`` for a message: its repr, cut short (a 5,000-character name is the fault)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def check_folder_name(folder: object, field: str = "folder") -> str:
    """``folder`` if it is a valid model folder name, else NameRefused naming ``field``.

    :func:`path_name_problem` with at most 200 characters: ``^[A-Za-z0-9._-]{1,200}$``,
    not ``.`` or ``..``, no trailing dot, no Windows device name.
    """
    problem = path_name_problem(folder, FOLDER_MAX)
    if problem is not None:
        raise NameRefused(f"{field} {_shown(folder)} {problem}")
    assert isinstance(folder, str)
    return folder


def check_file_name(name: object, field: str = "file") -> str:
    """``name`` if it is one plain file name (no directory), else NameRefused naming ``field``."""
    problem = path_name_problem(name, FILE_NAME_MAX)
    if problem is not None:
        raise NameRefused(f"{field} {_shown(name)} {problem}")
    assert isinstance(name, str)
    return name


def check_relative_path(name: object, field: str = "file") -> tuple[str, ...]:
    """The parts of ``name``, a relative path of plain names joined by ``/``.

    Each part follows :func:`path_name_problem`; so an absolute path, an empty part
    (``a//b``), ``.`` or ``..`` parts, a backslash, a drive or UNC prefix and a NUL are
    all refused. At most 16 parts and 1,000 characters. Raises NameRefused naming
    ``field``.
    """
    if not isinstance(name, str) or not name or len(name) > RELATIVE_PATH_MAX:
        raise NameRefused(
            f"{field} {_shown(name)} is not a plain relative file name: it must be 1 to "
            f"{RELATIVE_PATH_MAX} characters"
        )
    parts = tuple(name.split("/"))
    if len(parts) > RELATIVE_PATH_DEPTH:
        raise NameRefused(
            f"{field} {_shown(name)} is not a plain relative file name: it has more than "
            f"{RELATIVE_PATH_DEPTH} parts"
        )
    for part in parts:
        problem = path_name_problem(part, FILE_NAME_MAX)
        if problem is not None:
            raise NameRefused(
                f"{field} {_shown(name)} is not a plain relative file name: part "
                f"{_shown(part)} {problem}"
            )
    return parts
