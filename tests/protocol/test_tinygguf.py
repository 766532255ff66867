"""The tiny GGUF writer produces the metadata llama.cpp needs."""

from __future__ import annotations

from pathlib import Path

import gguf

from protocol.tinygguf import write_tiny_gguf


def test_tiny_gguf_metadata(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m" / "tiny.gguf", seed=1)
    assert 300_000 < path.stat().st_size < 1_000_000
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields

    def scalar(name: str) -> object:
        field = fields[name]
        return field.parts[field.data[0]][0]

    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert scalar("llama.context_length") == 512
    assert scalar("llama.embedding_length") == 64
    assert scalar("llama.block_count") == 2
    assert scalar("llama.attention.head_count") == 4
    assert scalar("tokenizer.ggml.bos_token_id") == 1
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.ffn_up.weight"} <= names
    assert len(fields["tokenizer.ggml.tokens"].data) == 3 + 256 + 8
    # Same seed, same bytes: the demo model is reproducible.
    again = write_tiny_gguf(tmp_path / "again.gguf", seed=1)
    assert again.read_bytes() == path.read_bytes()
