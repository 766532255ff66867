"""The records of downloads: what one is, how it is shown and kept, and its POST body.

:class:`Download` is a download's whole state. :meth:`Download.to_json` is the
contract's download JSON (docs/agent-api.md), :meth:`Download.to_record` what
``downloads.json`` keeps. Neither ever holds the Hugging Face token: it exists only on
the live object, and ``repr`` leaves it out too.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agent._errors import InvalidRequest, NotSupported
from agent._util import iso_time
from agent.engines import check_folder_name

__all__ = [
    "ACTIVE",
    "CANCELLED",
    "COMPLETED",
    "FAILED",
    "QUEUED",
    "RUNNING",
    "Download",
    "DownloadRequest",
    "FileEntry",
    "RateMeter",
    "parse_request",
]

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = (
    "Queued",
    "Running",
    "Completed",
    "Failed",
    "Cancelled",
)
ACTIVE = (QUEUED, RUNNING)
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class RateMeter:
    """Bytes per second over a sliding window; None until a span is measurable."""

    def __init__(self, *, window: float = 10.0, minimum: float = 0.5) -> None:
        self._samples: deque[tuple[float, int]] = deque()
        self._window = window
        self._minimum = minimum

    def add(self, now: float, done: int) -> None:
        """Record that ``done`` bytes were there at ``now`` (a monotonic time)."""
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self._window:
            self._samples.popleft()

    def reset(self) -> None:
        """Forget every sample (a download starts running again)."""
        self._samples.clear()

    def rate(self) -> float | None:
        """Bytes per second between the oldest and newest sample, or None."""
        if len(self._samples) < 2:
            return None
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        if t1 - t0 < self._minimum:
            return None
        return max(0.0, (b1 - b0) / (t1 - t0))


@dataclass(kw_only=True)
class FileEntry:
    """One selected file: what the hub says about it and how far it got."""

    name: str
    size: int | None
    sha256: str | None
    blob_id: str | None = None
    lfs: bool = False
    bytes_done: int = 0
    verified: bool = False

    def to_json(self) -> dict[str, Any]:
        """The contract's per-file object of a download."""
        return {
            "name": self.name,
            "size": self.size,
            "sha256": self.sha256,
            "bytesDone": self.bytes_done,
            "verified": self.verified,
        }

    def to_record(self) -> dict[str, Any]:
        """What downloads.json keeps of the file."""
        return {**self.to_json(), "blobId": self.blob_id, "lfs": self.lfs}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> FileEntry:
        """The file from its downloads.json record."""
        return cls(
            name=str(record["name"]),
            size=record.get("size"),
            sha256=record.get("sha256"),
            blob_id=record.get("blobId"),
            lfs=bool(record.get("lfs")),
            bytes_done=int(record.get("bytesDone") or 0),
            verified=bool(record.get("verified")),
        )


@dataclass(kw_only=True)
class Download:
    """One download's state; the token exists only here, only while it runs."""

    folder: str
    repo_id: str
    revision: str
    allow_patterns: list[str] | None
    files: list[FileEntry]
    state: str = QUEUED
    error: str | None = None
    needs_token: bool = False
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    token: str | None = field(default=None, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    rate: RateMeter = field(default_factory=RateMeter, repr=False)
    last_event: float = field(default=0.0, repr=False)
    cancelling: bool = field(default=False, repr=False)

    @property
    def bytes_done(self) -> int:
        """Bytes of the selected files on disk (or arrived) so far."""
        return sum(f.bytes_done for f in self.files)

    @property
    def bytes_total(self) -> int | None:
        """The selection's size; None when one file's size is unknown."""
        # One unknown size makes the total unknown: a percentage of a guess is worse
        # than a byte count that keeps rising.
        if any(f.size is None for f in self.files):
            return None
        return sum(f.size or 0 for f in self.files)

    def to_json(self, *, files: bool = True) -> dict[str, Any]:
        """The contract's download JSON (``files`` left out for the heartbeat)."""
        body: dict[str, Any] = {
            "folder": self.folder,
            "source": "huggingface",
            "repoId": self.repo_id,
            "revision": self.revision,
            "allowPatterns": self.allow_patterns,
            "state": self.state,
            "bytesDone": self.bytes_done,
            "bytesTotal": self.bytes_total,
            "rateBytesPerSecond": self.rate.rate() if self.state == RUNNING else None,
        }
        if files:
            body["files"] = [f.to_json() for f in self.files]
        body.update(
            {
                "error": self.error,
                "needsToken": self.needs_token,
                "createdAt": iso_time(self.created_at),
                "startedAt": iso_time(self.started_at) if self.started_at else None,
                "finishedAt": iso_time(self.finished_at) if self.finished_at else None,
            }
        )
        return body

    def to_record(self) -> dict[str, Any]:
        """What downloads.json keeps: everything but the token and the live rate."""
        return {
            "folder": self.folder,
            "repoId": self.repo_id,
            "revision": self.revision,
            "allowPatterns": self.allow_patterns,
            "state": self.state,
            "error": self.error,
            "needsToken": self.needs_token,
            "files": [f.to_record() for f in self.files],
            "createdAtEpoch": self.created_at,
            "startedAtEpoch": self.started_at,
            "finishedAtEpoch": self.finished_at,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Download:
        """The download from its downloads.json record (without a token, ever)."""
        return cls(
            folder=str(record["folder"]),
            repo_id=str(record["repoId"]),
            revision=str(record["revision"]),
            allow_patterns=record.get("allowPatterns"),
            files=[FileEntry.from_record(f) for f in record.get("files", [])],
            state=str(record.get("state", FAILED)),
            error=record.get("error"),
            needs_token=bool(record.get("needsToken")),
            created_at=float(record.get("createdAtEpoch") or time.time()),
            started_at=record.get("startedAtEpoch"),
            finished_at=record.get("finishedAtEpoch"),
        )


@dataclass(frozen=True, kw_only=True)
class DownloadRequest:
    """A checked POST /downloads body; ``token`` lives in memory only."""

    folder: str
    repo_id: str
    revision: str
    allow_patterns: list[str] | None
    token: str | None = field(repr=False)


def parse_request(body: Any) -> DownloadRequest:
    """Check a POST /downloads body; 400 naming the field, 501 for another source."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    source = body.get("source", "huggingface")
    if source != "huggingface":
        raise NotSupported(f"source {source!r} is not supported by this agent (only 'huggingface')")
    folder = check_folder_name(body.get("folder"))
    repo_id = body.get("repoId")
    if not isinstance(repo_id, str) or not repo_id:
        raise InvalidRequest("field 'repoId' is required and must be a non-empty string")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise InvalidRequest(f"field 'repoId' is not a Hugging Face repo id: {exc}") from None
    revision = body.get("revision")
    if not isinstance(revision, str) or not COMMIT_RE.fullmatch(revision):
        raise InvalidRequest(
            f"field 'revision' must be a 40-hex commit SHA, not {revision!r}: the master "
            "resolves branch and tag names before it sends a download, so what lands on "
            "the node can never change under the same name"
        )
    patterns = body.get("allowPatterns")
    if patterns is not None and (
        not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns)
    ):
        raise InvalidRequest("field 'allowPatterns' must be a list of non-empty strings or null")
    token = body.get("token")
    if token is not None and (not isinstance(token, str) or not token):
        # The value itself is never echoed: it may be a token pasted in the wrong field.
        raise InvalidRequest("field 'token' must be a non-empty string or null")
    return DownloadRequest(
        folder=folder,
        repo_id=repo_id,
        revision=revision,
        allow_patterns=patterns,
        token=token,
    )
