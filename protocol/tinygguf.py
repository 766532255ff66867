"""A tiny llama-architecture GGUF that a real llama-server loads in about a second.

Used by the tests and by the master's ``up --demo``: it exercises the whole path (load,
Ready, chat completion through the proxy) without downloading a model. The weights are
random, so the text it produces is noise; the file is about 0.5 MB.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_tiny_gguf"]

_EMBED = 64
_BLOCKS = 2
_HEADS = 4
_FFN = 128
_CONTEXT = 512
_WORDS = ["▁hello", "▁world", "▁the", "▁a", "▁model", "▁is", "▁tiny", "."]
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_gguf(
    path: str | os.PathLike[str], seed: int = 0, *, context: int = _CONTEXT
) -> Path:
    """Write the tiny model to ``path`` (parent folders created) and return the path.

    ``context`` is the training context the file declares; llama-server ends every
    answer there (prompt and answer together), so a test that needs a stream that
    cannot end early asks for more.
    """
    # Imported here so importing the protocol package never requires numpy or gguf.
    import gguf
    import numpy as np

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
    ]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += _WORDS
    types += [gguf.TokenType.NORMAL] * len(_WORDS)
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(i + 1) for i in range(len(_WORDS))]
    n_vocab = len(tokens)

    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_name("mirbad-tiny")
    writer.add_context_length(context)
    writer.add_embedding_length(_EMBED)
    writer.add_block_count(_BLOCKS)
    writer.add_feed_forward_length(_FFN)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_HEADS)
    writer.add_rope_dimension_count(_EMBED // _HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(_CHAT_TEMPLATE)

    def tensor(name: str, *shape: int) -> None:
        data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        if name.endswith("norm.weight"):
            data = np.ones(shape, dtype=np.float32)
        writer.add_tensor(name, data)

    tensor("token_embd.weight", n_vocab, _EMBED)
    tensor("output_norm.weight", _EMBED)
    tensor("output.weight", n_vocab, _EMBED)
    for block in range(_BLOCKS):
        prefix = f"blk.{block}."
        tensor(prefix + "attn_norm.weight", _EMBED)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(prefix + part + ".weight", _EMBED, _EMBED)
        tensor(prefix + "ffn_norm.weight", _EMBED)
        tensor(prefix + "ffn_gate.weight", _FFN, _EMBED)
        tensor(prefix + "ffn_down.weight", _EMBED, _FFN)
        tensor(prefix + "ffn_up.weight", _FFN, _EMBED)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
