"""Unpacking a tar or zip archive the agent did not make: every member judged first.

:func:`safe_extract` reads the whole member list, bounded, before it writes one byte,
and refuses the archive (``InstallError`` naming the member) when any member:

- has a name that leaves the target: absolute (``/x``, ``C:``, ``\\\\server``), a ``..``
  part, a backslash, colon, NUL or control character (separators, drives and streams
  on Windows), a part ending in a dot or a space, or a Windows device name
  (``aux.c``: the one rule of protocol.names), or lies under a link of the archive;
- is a symbolic or hard link whose target, followed through the archive's own links,
  leaves the target (``a -> .`` then ``b -> a/..`` is caught: ``..`` after a link is
  taken where the link points, not lexically);
- is a device, a FIFO, a sparse file or another kind than file, folder and link;
- appears twice, or pushes the count past ``max_members`` or the declared sizes past
  ``max_bytes``.

The counting stops at the first member over a limit, so a bomb of a million empty
members or of terabytes is refused having read one header more than the limit. While
a zip is unpacked the bytes written are counted again and the unpacking stops at the
declared size of each member and at ``max_bytes``: a zip's headers can lie. A tar's
sizes cannot (tarfile copies exactly the header's size), and its members are written
through tarfile's ``data`` filter as a second line.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agent._config import ARCHIVE_MAX_BYTES, ARCHIVE_MAX_MEMBERS
from agent._errors import InstallError
from protocol.names import is_device_name

__all__ = ["ArchiveLimits", "safe_extract"]

_MAX_PART = 255
_MAX_NAME = 4096
_MAX_LINK_HOPS = 40
# Separators, drives and streams on Windows, and what a terminal or a log would act on.
_BAD_CHARS = re.compile(r"[\\:\x00-\x1f\x7f]")
_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ArchiveLimits:
    """How much one archive may unpack (the agent's ArchiveMaxMembers, ArchiveMaxBytes)."""

    max_members: int = ARCHIVE_MAX_MEMBERS
    max_bytes: int = ARCHIVE_MAX_BYTES


@dataclass(frozen=True)
class _Member:
    """One member as both formats are judged: its normalised name, kind, size, link."""

    name: str
    kind: str  # "file", "dir", "symlink" or "hardlink"
    size: int
    link: str = ""


def _refuse(archive: Path, what: str) -> InstallError:
    return InstallError(f"{archive.name}: {what}; refused before unpacking anything")


def _clean_name(archive: Path, raw: str) -> str:
    """The member's relative name, ``/``-joined, or the refusal naming why it leaves.

    ``""`` for a name of the target itself (``./``), which only a folder may have.
    """
    shown = repr(raw[:200])
    if not raw or len(raw) > _MAX_NAME:
        raise _refuse(archive, f"member name {shown} is empty or longer than {_MAX_NAME}")
    if raw.startswith("/") or _BAD_CHARS.search(raw):
        raise _refuse(
            archive,
            f"member {shown} is absolute or holds a backslash, colon or control character "
            "(a separator, drive or stream on Windows): it leaves the target",
        )
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    for part in parts:
        if part == "..":
            raise _refuse(archive, f"member {shown} has a '..' part: it leaves the target")
        if len(part) > _MAX_PART or part.endswith((".", " ")) or is_device_name(part):
            raise _refuse(
                archive,
                f"member {shown} has the part {part[:80]!r}, which is longer than "
                f"{_MAX_PART}, ends in a dot or a space, or is a Windows device name",
            )
    return "/".join(parts)


def _resolve(
    archive: Path, start: list[str], target: str, links: dict[str, str], what: str
) -> list[str]:
    """``target`` taken from the folder ``start``, following the archive's own links.

    Raises the refusal, naming ``what`` is resolved, when the path leaves the target
    or the links loop.
    """
    resolved = list(start)
    pending = [p for p in target.split("/") if p not in ("", ".")]
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if not resolved:
                raise _refuse(archive, f"{what} leaves the target")
            resolved.pop()
            continue
        resolved.append(part)
        link = links.get("/".join(resolved))
        if link is not None:
            hops += 1
            if hops > _MAX_LINK_HOPS or link.startswith("/"):
                raise _refuse(
                    archive,
                    f"{what} goes through a link that loops or is absolute: it leaves the target",
                )
            resolved.pop()
            pending[:0] = [p for p in link.split("/") if p not in ("", ".")]
    return resolved


def _judge(archive: Path, members: Iterator[_Member], limits: ArchiveLimits) -> list[_Member]:
    """Every member checked against the rules of the module docstring, count and size
    bounded while they are read."""
    seen: dict[str, _Member] = {}
    total = 0
    for member in members:
        if len(seen) >= limits.max_members:
            raise _refuse(
                archive,
                f"more than {limits.max_members} members (ArchiveMaxMembers); refusing it",
            )
        total += member.size
        if total > limits.max_bytes:
            raise _refuse(
                archive,
                f"its members declare more than {limits.max_bytes} bytes (ArchiveMaxBytes)",
            )
        if member.name in seen:
            raise _refuse(archive, f"member {member.name!r} appears twice")
        seen[member.name] = member
    links = {m.name: m.link for m in seen.values() if m.kind == "symlink"}
    for member in seen.values():
        parts = member.name.split("/")
        # A member under a link would be written wherever the link points.
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in links:
                raise _refuse(archive, f"member {member.name!r} lies under a link of the archive")
        if member.kind not in ("symlink", "hardlink"):
            continue
        what = f"{'link' if member.kind == 'symlink' else 'hard link'} {member.name!r} -> "
        what += repr(member.link[:200])
        if not member.link or member.link.startswith("/") or _BAD_CHARS.search(member.link):
            raise _refuse(
                archive,
                f"{what} is absolute, empty or holds a backslash, colon or control "
                "character: it leaves the target",
            )
        if member.kind == "symlink":
            _resolve(archive, parts[:-1], member.link, links, what)
        else:
            # A hard link names another member, from the archive's top.
            found = "/".join(_resolve(archive, [], member.link, links, what))
            if found not in seen or seen[found].kind != "file":
                raise _refuse(archive, f"{what} names no file of the archive")
    return list(seen.values())


def _tar_members(archive: Path, tar: tarfile.TarFile) -> Iterator[_Member]:
    # Iterating reads one header at a time: the count stops a bomb of members early.
    for info in tar:
        name = _clean_name(archive, info.name)
        if not name:
            if info.isdir():
                continue  # "./": the target itself
            raise _refuse(archive, f"member {info.name!r} is not a folder but names the target")
        if info.issparse():
            raise _refuse(archive, f"member {info.name!r} is a sparse file")
        if info.isreg():
            yield _Member(name, "file", info.size)
        elif info.isdir():
            yield _Member(name, "dir", 0)
        elif info.issym():
            yield _Member(name, "symlink", 0, info.linkname)
        elif info.islnk():
            yield _Member(name, "hardlink", 0, info.linkname)
        else:
            raise _refuse(
                archive,
                f"member {info.name!r} is a device, FIFO or other special file, not a file, "
                "folder or link",
            )


def _zip_kind(info: zipfile.ZipInfo) -> str | None:
    """file, dir or symlink from the Unix mode a zip may carry; None: another kind."""
    mode = info.external_attr >> 16
    if info.is_dir() or stat.S_ISDIR(mode):
        return "dir"
    if not stat.S_IFMT(mode) or stat.S_ISREG(mode):  # no type bits: a plain file
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return None


def _zip_members(
    archive: Path, zf: zipfile.ZipFile, infos: dict[str, zipfile.ZipInfo]
) -> Iterator[_Member]:
    """The zip's members from its central directory; ``infos`` learns each one's entry."""
    for info in zf.infolist():
        name = _clean_name(archive, info.filename)
        kind = _zip_kind(info)
        if not name:
            if kind == "dir":
                continue
            raise _refuse(archive, f"member {info.filename!r} is not a folder but names the target")
        if kind is None:
            raise _refuse(
                archive,
                f"member {info.filename!r} is a device, FIFO or other special file, not a "
                "file, folder or link",
            )
        link = ""
        if kind == "symlink":
            # zipfile never reads past the declared size, so this read is bounded.
            if info.file_size > _MAX_NAME:
                raise _refuse(archive, f"link {info.filename!r} has a target over {_MAX_NAME}")
            link = zf.read(info).decode("utf-8", errors="replace")
        infos.setdefault(name, info)
        yield _Member(name, kind, info.file_size if kind == "file" else 0, link)


def _copy_counted(
    archive: Path, source: IO[bytes], dest: IO[bytes], member: _Member, budget: list[int]
) -> None:
    """Copy at most the member's declared size and what is left of ``max_bytes``."""
    written = 0
    while chunk := source.read(_CHUNK):
        written += len(chunk)
        budget[0] -= len(chunk)
        if written > member.size or budget[0] < 0:
            raise InstallError(
                f"{archive.name}: member {member.name!r} inflates past its declared "
                f"{member.size} bytes or past ArchiveMaxBytes (a lying header); the "
                "unpacking stopped there and what it wrote is removed"
            )
        dest.write(chunk)


def _extract_zip(
    archive: Path,
    zf: zipfile.ZipFile,
    members: list[_Member],
    infos: dict[str, zipfile.ZipInfo],
    target: Path,
    limits: ArchiveLimits,
) -> None:
    budget = [limits.max_bytes]
    for member in members:
        path = target.joinpath(*member.name.split("/"))
        if member.kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.parent.resolve().is_relative_to(target):
            raise InstallError(
                f"{archive.name}: member {member.name!r} would be written outside the target"
            )
        if member.kind == "symlink":
            os.symlink(member.link, path)
            continue
        # Never through a link, never over a file: the judged tree is all there is.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with zf.open(infos[member.name]) as source, open(os.open(path, flags, 0o644), "wb") as dest:
            _copy_counted(archive, source, dest, member, budget)


def safe_extract(archive: Path, target: Path, limits: ArchiveLimits | None = None) -> None:
    """Unpack a tar (any compression tarfile reads) or zip ``archive`` into ``target``.

    ``target`` must be absent or empty. Every member is judged before anything is
    written (the module docstring); a refusal is an InstallError naming the archive and
    the member. When unpacking fails half-way, what it wrote is removed.
    """
    limits = limits or ArchiveLimits()
    existed = target.exists()
    if existed and (not target.is_dir() or any(target.iterdir())):
        raise InstallError(f"{archive.name}: the target {target} is not an empty folder")
    target.mkdir(parents=True, exist_ok=True)
    target = target.resolve()
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                infos: dict[str, zipfile.ZipInfo] = {}
                members = _judge(archive, _zip_members(archive, zf, infos), limits)
                _extract_zip(archive, zf, members, infos, target, limits)
            return
        with tarfile.open(archive) as tar:
            _judge(archive, _tar_members(archive, tar), limits)
            # Judging read every header, so these are the members judged; the "data"
            # filter repeats the checks inside tarfile and drops unsafe modes.
            tar.extractall(target, filter="data")
    except BaseException as exc:
        _clear(target, existed)
        if isinstance(exc, tarfile.TarError | zipfile.BadZipFile | EOFError | OSError):
            raise InstallError(
                f"{archive.name}: cannot be unpacked ({type(exc).__name__}: {exc})"
            ) from None
        raise


def _clear(target: Path, keep: bool) -> None:
    """Remove what an unpacking wrote (and ``target`` itself unless it was there before)."""
    if not keep:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
