"""The bounded GGUF reader: the tiny model parses; each kind of malformed file is refused fast."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import pytest

from agent.weights._gguf import GgufInvalid, read_header, summary
from protocol.tinygguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = write_tiny_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf")
    return path.read_bytes()


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "x.gguf"
    path.write_bytes(data)
    return path


def test_tiny_model_summary_matches_the_gguf_package(tiny: bytes, tmp_path: Path) -> None:
    path = _file(tmp_path, tiny)
    header = read_header(path)
    info = summary(header)
    assert info["architecture"] == "llama" and info["blockCount"] == 2
    assert info["embeddingLength"] == 64 and info["contextLength"] == 512
    assert info["headCountKv"] == 4 and info["keyLength"] == 16
    reference = gguf.GGUFReader(path)
    assert header.tensor_count == len(reference.tensors)
    assert header.data_offset == reference.data_offset
    assert header.tensor_bytes == sum(int(t.n_bytes) for t in reference.tensors)


def _refused(tmp_path: Path, data: bytes, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(GgufInvalid, match=message):
        read_header(_file(tmp_path, data))
    assert time.monotonic() - started < 2, "a malformed file must be refused quickly"


def test_four_byte_file(tmp_path: Path) -> None:
    _refused(tmp_path, b"GGUF", "too small")


def test_not_gguf(tmp_path: Path) -> None:
    _refused(tmp_path, b"GGML" + bytes(40), "not a GGUF file")


def test_truncated(tiny: bytes, tmp_path: Path) -> None:
    _refused(tmp_path, tiny[: len(tiny) // 2], "outside the file|file ends")
    _refused(tmp_path, tiny[:200], "cannot fit|file ends")
    _refused(tmp_path, tiny[:3000], "file ends")


def test_huge_counts(tiny: bytes, tmp_path: Path) -> None:
    huge_kv = tiny[:16] + struct.pack("<Q", 2**60) + tiny[24:]
    _refused(tmp_path, huge_kv, "metadata entries cannot fit")
    huge_tensors = tiny[:8] + struct.pack("<Q", 2**40) + tiny[16:]
    _refused(tmp_path, huge_tensors, "tensors cannot fit")


def test_string_running_past_the_end(tiny: bytes, tmp_path: Path) -> None:
    # The first metadata key's length, right after the 24-byte preamble.
    bad = tiny[:24] + struct.pack("<Q", len(tiny) * 4) + tiny[32:]
    _refused(tmp_path, bad, "metadata key")


def _single_kv(key: str, kind: int, payload: bytes, tensors: int = 0) -> bytes:
    body = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + payload
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, 1) + body + bytes(64)


def test_bad_alignment(tmp_path: Path) -> None:
    _refused(tmp_path, _single_kv("general.alignment", 4, struct.pack("<I", 3)), "power of two")


def test_array_longer_than_the_file(tmp_path: Path) -> None:
    payload = struct.pack("<IQ", 4, 2**23)  # uint32 array of 8 Mi items in a tiny file
    _refused(tmp_path, _single_kv("x.values", 9, payload), "x.values array")


def test_unknown_value_type(tmp_path: Path) -> None:
    _refused(tmp_path, _single_kv("x", 99, b""), "unknown value type 99")


def test_tensor_outside_the_file(tiny: bytes, tmp_path: Path) -> None:
    last = gguf.GGUFReader(_file(tmp_path, tiny)).tensors[-1]
    # Point the last tensor's offset far beyond the end of the file.
    name = last.name.encode()
    at = tiny.rindex(struct.pack("<Q", len(name)) + name)
    field = at + 8 + len(name) + 4 + 8 * len(last.shape) + 4
    bad = tiny[:field] + struct.pack("<Q", 2**40) + tiny[field + 8 :]
    _refused(tmp_path, bad, "outside the file")


async def test_gguf_endpoint(running_agent, tiny: bytes) -> None:
    root = running_agent.server.config.models_root_path
    (root / "one").mkdir()
    (root / "one" / "m.gguf").write_bytes(tiny)
    (root / "one" / "mmproj-x.gguf").write_bytes(b"not a model")
    url = running_agent.url
    async with running_agent.session.get(url("/agent/v1/folders/one/gguf")) as resp:
        body = await resp.json()
        assert resp.status == 200 and body["file"] == "m.gguf" and body["blockCount"] == 2
    (root / "one" / "b.gguf").write_bytes(tiny[:100])
    async with running_agent.session.get(url("/agent/v1/folders/one/gguf")) as resp:
        body = await resp.json()
        assert resp.status == 400
        assert body["error"]["details"]["candidates"] == ["b.gguf", "m.gguf"]
    async with running_agent.session.get(url("/agent/v1/folders/one/gguf?file=b.gguf")) as resp:
        assert resp.status == 422 and (await resp.json())["error"]["code"] == "gguf_invalid"
    async with running_agent.session.get(url("/agent/v1/folders/one/gguf?file=../x")) as resp:
        assert resp.status == 404
    async with running_agent.session.get(url("/agent/v1/folders/nope/gguf")) as resp:
        assert resp.status == 404
