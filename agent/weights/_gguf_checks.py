"""What a well-formed GGUF header must also say before an estimate is computed from it.

The reader (``_gguf``) proves the file is well formed: every count, length and offset
fits in it. These rules refuse the headers that parse but cannot be a real model: a key
of the wrong type, a context length or head count of zero or below, a block count beyond
the tensors the file holds, dimensions whose products overflow 64 bits, a split count
that is absurd or disagrees with the parts present. Each refusal is :class:`GgufInvalid`
(``422 gguf_invalid``) naming the key and what was wrong with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType

from agent._errors import ApiError
from protocol.errors import AgentCode

__all__ = [
    "ARCH_KEYS",
    "GENERAL_KEYS",
    "MAX_SPLIT_COUNT",
    "PER_LAYER_KEYS",
    "ArrayInfo",
    "GgufInvalid",
    "check_model",
    "check_part",
    "check_split",
    "check_split_tensors",
    "describe",
    "integer",
    "is_model_file",
    "show",
    "split_parts",
]

INT64_MAX = 2**63 - 1
# gguf-split names parts NAME-00001-of-0000N; a count above this is no real model.
MAX_SPLIT_COUNT = 4096
# The keys the summary and these rules read, all others are walked and forgotten.
GENERAL_KEYS = frozenset(
    {
        "general.architecture",
        "general.alignment",
        "general.file_type",
        "split.count",
        "split.no",
        "split.tensors.count",
        "tokenizer.ggml.tokens",
    }
)
# Sizes and switches checked only for being 0 or more (read as "{architecture}.{key}").
SIZE_KEYS = (
    "pooling_type",
    "full_attention_interval",
    "ssm.conv_kernel",
    "ssm.inner_size",
    "ssm.state_size",
    "ssm.group_count",
    "wkv.head_size",
)
# Read as "{architecture}.{key}".
ARCH_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "vocab_size",
    "attention.causal",
    *SIZE_KEYS,
)
# llama.cpp reads these as one value or as one value per layer (an integer array).
PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv")
# Recurrent models (Mamba, RWKV) have no attention heads; their converters write a
# head count of 0 ("unused, but required when loading"), so 0 is theirs to say.
_RECURRENT_KEYS = ("ssm.state_size", "ssm.inner_size", "wkv.head_size")
_INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)


class GgufInvalid(ApiError):
    """A GGUF file that is malformed or cannot be a model (``422 gguf_invalid``)."""

    code = AgentCode.GGUF_INVALID
    status = 422


@dataclass(frozen=True)
class ArrayInfo:
    """An array value the reader did not keep: its item type and length and, for a
    short integer array (a per-layer value), its smallest and largest item."""

    item_type: int
    count: int
    low: int | None = None
    high: int | None = None

    def describe(self) -> str:
        try:
            item = GGUFValueType(self.item_type).name.lower()
        except ValueError:
            item = str(self.item_type)
        return f"an array of {self.count} {item}"


def show(text: str) -> str:
    """A name from the file as a message can carry it: short, printable."""
    if len(text) <= 80 and text.isprintable():
        return text
    return repr(text[:80]) + ("..." if len(text) > 80 else "")


def describe(value: Any) -> str:
    """What a kept value is, for a message: its type, never its content."""
    if isinstance(value, ArrayInfo):
        return value.describe()
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, int):
        return "an integer"
    return type(value).__name__


def integer(
    md: Mapping[str, Any], key: str, *, file: str, per_layer: bool = False
) -> tuple[int, int] | None:
    """``key``'s value as (smallest, largest): one integer gives it twice, a per-layer
    integer array its range. Absent is None; any other type is refused."""
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        low = high = value
    elif (
        per_layer
        and isinstance(value, ArrayInfo)
        and value.item_type in _INT_TYPES
        and value.low is not None
        and value.high is not None
    ):
        low, high = value.low, value.high
    else:
        what = "an integer or one integer per layer" if per_layer else "an integer"
        raise GgufInvalid(f"{file}: {show(key)} is {describe(value)}, not {what}")
    if high > INT64_MAX:
        raise GgufInvalid(f"{file}: {show(key)} is {high}, beyond 2^63 - 1 (it overflows 64 bits)")
    return low, high


def _at_least(
    md: Mapping[str, Any], key: str, minimum: int, *, file: str, per_layer: bool = False
) -> int | None:
    """The largest value of ``key`` (None when absent), refused below ``minimum``."""
    found = integer(md, key, file=file, per_layer=per_layer)
    if found is None:
        return None
    low, high = found
    if low < 0 or high < minimum:
        bad = low if low < 0 else high
        raise GgufInvalid(f"{file}: {show(key)} is {bad}; a model needs at least {minimum}")
    return high


def _product(file: str, what: str, *factors: int) -> None:
    out = 1
    for factor in factors:
        out *= factor
    if out > INT64_MAX:
        raise GgufInvalid(f"{file}: {what} = {out} overflows 64 bits; no model is that large")


def check_model(md: Mapping[str, Any], *, file: str, tensor_count: int) -> None:
    """Refuse a header whose model keys cannot describe a real model.

    ``tensor_count`` is the number of tensors of all split parts together.
    """
    arch = md.get("general.architecture")
    if arch is not None and not isinstance(arch, str):
        raise GgufInvalid(
            f"{file}: general.architecture is {describe(arch)}, not a string naming it"
        )
    file_type = md.get("general.file_type")
    if file_type is not None:
        _at_least(md, "general.file_type", 0, file=file)
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and not (
        isinstance(tokens, ArrayInfo) and tokens.item_type == GGUFValueType.STRING
    ):
        raise GgufInvalid(
            f"{file}: tokenizer.ggml.tokens is {describe(tokens)}, not an array of strings"
        )
    if not arch:
        return  # no architecture: no model keys to read (a projector, a vocabulary)
    p = f"{arch}."
    causal = md.get(p + "attention.causal")
    if causal is not None and not isinstance(causal, bool):
        raise GgufInvalid(f"{file}: {show(p)}attention.causal is {describe(causal)}, not a bool")
    recurrent = any(md.get(p + key) is not None for key in _RECURRENT_KEYS)
    blocks = _at_least(md, p + "block_count", 1, file=file)
    context = _at_least(md, p + "context_length", 1, file=file)
    embedding = _at_least(md, p + "embedding_length", 1, file=file)
    heads = _at_least(
        md, p + "attention.head_count", 0 if recurrent else 1, file=file, per_layer=True
    )
    kv_heads = _at_least(
        md,
        p + "attention.head_count_kv",
        0 if recurrent or heads == 0 else 1,
        file=file,
        per_layer=True,
    )
    key_length = _at_least(md, p + "attention.key_length", 0, file=file)
    value_length = _at_least(md, p + "attention.value_length", 0, file=file)
    vocab = _at_least(md, p + "vocab_size", 0, file=file)
    sizes = {key: _at_least(md, p + key, 0, file=file) for key in SIZE_KEYS}
    if blocks is not None and blocks > tensor_count:
        raise GgufInvalid(
            f"{file}: {show(p)}block_count is {blocks} but the file holds only {tensor_count} "
            "tensors; every block has tensors of its own"
        )
    # The products the estimate computes, with the summary's defaults.
    kv = kv_heads or heads or 0
    head_dim = embedding // heads if embedding and heads else 0
    key_length, value_length = key_length or head_dim, value_length or head_dim
    _product(
        file,
        f"{p}context_length * block_count * attention.head_count_kv * (key_length + value_length)",
        context or 0,
        blocks or 0,
        kv,
        key_length + value_length,
    )
    _product(file, f"{p}attention.head_count * key_length", heads or 0, key_length)
    if vocab is None and isinstance(tokens, ArrayInfo):
        vocab = tokens.count
    _product(file, f"{p}embedding_length * vocab_size", embedding or 0, vocab or 0)
    inner, state = sizes["ssm.inner_size"] or 0, sizes["ssm.state_size"] or 0
    groups = sizes["ssm.group_count"] or 0
    _product(
        file,
        f"{p}ssm.conv_kernel * (ssm.inner_size + 2 * ssm.group_count * ssm.state_size)",
        sizes["ssm.conv_kernel"] or 0,
        inner + 2 * groups * state,
    )
    _product(file, f"{p}ssm.state_size * ssm.inner_size", state, inner)


_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_model_file(name: str) -> bool:
    """A GGUF an instance can be started from: not a projector, not a later split part."""
    if not name.endswith(".gguf") or name.startswith("mmproj-"):
        return False
    match = _SPLIT_NAME.match(name)
    return match is None or int(match["index"]) == 1


def split_parts(md: Mapping[str, Any], *, file: str) -> list[str]:
    """The file names of the parts of the model whose first part is ``file`` (``[file]``
    when it is not split), once its split keys agree with its name: gguf-split names
    the parts ``NAME-0000i-of-0000N.gguf``, and llama.cpp is given the first."""
    match = _SPLIT_NAME.match(file)
    count = check_split(
        md,
        file=file,
        name_count=int(match["count"]) if match else 1,
        name_index=int(match["index"]) if match else 1,
    )
    if count == 1 or match is None:
        return [file]
    return [f"{match['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def check_split(md: Mapping[str, Any], *, file: str, name_count: int, name_index: int) -> int:
    """The part count of the file named ``file`` (1: not split), after checking that its
    split keys agree with its name (``NAME-0000i-of-0000N.gguf`` gives i and N)."""
    found = integer(md, "split.count", file=file)
    count = 1 if found is None else found[0]
    if not 1 <= count <= MAX_SPLIT_COUNT:
        raise GgufInvalid(
            f"{file}: split.count {count} is absurd; a split model has 1 to {MAX_SPLIT_COUNT} parts"
        )
    if count != name_count:
        said = "absent" if found is None else str(count)
        raise GgufInvalid(
            f"{file}: split.count is {said} but the file name says {name_count} parts; "
            "split parts are named NAME-00001-of-0000N.gguf after the count they hold"
        )
    if count > 1 and name_index != 1:
        raise GgufInvalid(
            f"{file}: is part {name_index} of {count}; read the first part "
            f"(...-00001-of-{count:05d}.gguf), which llama.cpp is given"
        )
    check_part(md, file=file, count=count, index=1)
    return count


def check_part(md: Mapping[str, Any], *, file: str, count: int, index: int) -> None:
    """A split part must say which part of how many it is (llama.cpp refuses it else)."""
    if count == 1:
        number = integer(md, "split.no", file=file)
        if number is not None and number[0] != 0:
            raise GgufInvalid(f"{file}: split.no is {number[0]} in a file that is not split")
        return
    part_count = integer(md, "split.count", file=file)
    if part_count is None or part_count[0] != count:
        said = "absent" if part_count is None else str(part_count[0])
        raise GgufInvalid(
            f"{file}: split.count is {said} but the first part says {count}; the parts "
            "are not of one split"
        )
    number = integer(md, "split.no", file=file)
    if number is None or number[0] != index - 1:
        said = "absent" if number is None else str(number[0])
        raise GgufInvalid(
            f"{file}: split.no is {said} but this file is part {index} of {count} "
            f"(split.no {index - 1})"
        )


def check_split_tensors(md: Mapping[str, Any], *, file: str, total: int) -> None:
    """``split.tensors.count``, when present, is the tensors of all parts together."""
    found = integer(md, "split.tensors.count", file=file)
    if found is not None and found[0] != total:
        raise GgufInvalid(
            f"{file}: split.tensors.count is {found[0]} but the parts hold {total} tensors"
        )
