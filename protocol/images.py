"""Container image references, parsed one way on both sides.

The master checks a model's ``image`` when it is saved; the agent parses the same
field of a launch again before its image policy (``ApprovedImages``,
``AllowTagPulls``: docs/agent.md) looks at it. A reference is
``[registry[:port]/]path[:tag][@sha256:<64 hex>]``, the grammar Docker's reference
package accepts, restricted to lower-case paths and the one digest algorithm in use;
anything else (spaces, upper case paths, ``--flags``, URLs) is refused with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DIGEST_RE", "ImageRef", "ImageRefused", "parse_image"]

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*(?::[0-9]{1,5})?)"
_REFERENCE_RE = re.compile(
    rf"(?:(?P<host>{_HOST})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)
MAX_LENGTH = 512


class ImageRefused(ValueError):
    """``value`` is not an image reference; the message says what is wrong."""


@dataclass(frozen=True)
class ImageRef:
    """A parsed reference: ``repository`` (registry and path), ``tag``, ``digest``."""

    repository: str
    tag: str | None
    digest: str | None

    @property
    def by_digest(self) -> bool:
        """True when the reference pins the content (``@sha256:...``)."""
        return self.digest is not None

    def __str__(self) -> str:
        text = self.repository
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_image(value: object, field: str = "image") -> ImageRef:
    """``value`` as an :class:`ImageRef`; :class:`ImageRefused` naming ``field`` otherwise."""
    if not isinstance(value, str) or not value:
        raise ImageRefused(f"{field} must be a non-empty image reference")
    if len(value) > MAX_LENGTH:
        raise ImageRefused(f"{field} is longer than {MAX_LENGTH} characters")
    match = _REFERENCE_RE.fullmatch(value)
    if match is None:
        raise ImageRefused(
            f"{field} {value!r} is not an image reference: use "
            "[registry/]name[:tag][@sha256:<64 hex digits>] with a lower-case name"
        )
    host = match["host"]
    # "name:tag" alone also reads as host "name" with port-less path; Docker's rule: the
    # first component is a registry only if it has a '.' or ':' or is 'localhost'.
    if host is not None and not ("." in host or ":" in host or host == "localhost"):
        repository = f"{host}/{match['path']}"
        if not re.fullmatch(_COMPONENT, host):
            raise ImageRefused(f"{field} {value!r}: {host!r} is neither a registry nor a name")
    else:
        repository = f"{host}/{match['path']}" if host else match["path"]
    return ImageRef(repository=repository, tag=match["tag"], digest=match["digest"])
