"""Split GGUFs: the weights term adds every part, and only the first part is a model file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from agent.weights._gguf import GgufInvalid, is_model_file, read_summary


def write_part(path: Path, *, index: int, count: int, elements: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint16("split.no", index)
    writer.add_uint16("split.count", count)
    writer.add_block_count(2)
    writer.add_tensor(f"t{index}", np.zeros(elements, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tensor_bytes_of_all_parts(tmp_path: Path) -> None:
    names = [f"big-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for i, name in enumerate(names):
        write_part(tmp_path / name, index=i, count=3, elements=256 * (i + 1))
    summary = read_summary(tmp_path / names[0])
    assert summary["splitCount"] == 3
    assert summary["parts"] == names
    assert summary["tensorBytes"] == 256 * 4
    assert summary["tensorBytesAllParts"] == (256 + 512 + 768) * 4


def test_a_missing_part_is_reported(tmp_path: Path) -> None:
    write_part(tmp_path / "big-00001-of-00002.gguf", index=0, count=2, elements=16)
    with pytest.raises(GgufInvalid, match=r"split part big-00002-of-00002\.gguf of 2 is missing"):
        read_summary(tmp_path / "big-00001-of-00002.gguf")


def test_model_file_candidates() -> None:
    assert is_model_file("model-Q8_0.gguf")
    assert is_model_file("big-00001-of-00003.gguf")
    assert not is_model_file("big-00002-of-00003.gguf")
    assert not is_model_file("mmproj-model-f16.gguf")
    assert not is_model_file("README.md")
