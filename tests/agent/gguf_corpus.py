"""GGUF files built byte by byte: small valid models, and one hostile file per bug class.

``build`` writes a :class:`Spec` (metadata entries and tensors, any types, any values)
the way the GGUF format lays it out, so a test or the fuzzer (tests/agent/fuzz_gguf.py)
can say exactly which field is wrong. ``REGRESSIONS`` holds one file per class of the
published llama.cpp and Ollama GGUF CVEs (counts, lengths, dimensions, offsets,
alignment, value types, duplicates); ``SEMANTIC`` the headers that parse but cannot be
a model. Each case carries the pattern its refusal must match: the key or field named.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

U8, I8, U16, I16 = 0, 1, 2, 3
U32, I32, F32, BOOL = 4, 5, 6, 7
STRING, ARRAY, U64, I64, F64 = 8, 9, 10, 11, 12
_FORMATS = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<?",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}
TENSOR_F32 = int(GGMLQuantizationType.F32)
assert GGUFValueType.FLOAT64 == F64  # the numbering is the format's, checked once
# A file is never padded with more tensor data than this (hostile shapes claim more).
DATA_CAP = 1 << 20


def fit(vtype: int, value: int) -> int:
    """``value`` wrapped into the range of an integer value type (as C would store it)."""
    bits = {U8: 8, I8: 8, U16: 16, I16: 16, U32: 32, I32: 32, U64: 64, I64: 64}[vtype]
    value %= 1 << bits
    if vtype in (I8, I16, I32, I64) and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


def u32(value: int) -> bytes:
    return struct.pack("<I", value % 2**32)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value % 2**64)


def string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw) if length is None else length) + raw


def value_bytes(vtype: int, value: Any) -> bytes:
    """A value as the file stores it; an array's value is (item type, items)."""
    if vtype == STRING:
        return string(value)
    if vtype == ARRAY:
        item_type, items = value
        body = b"".join(value_bytes(item_type, item) for item in items)
        return u32(item_type) + u64(len(items)) + body
    if vtype in _FORMATS:
        fmt = _FORMATS[vtype]
        if fmt in ("<f", "<d"):
            return struct.pack(fmt, float(value))
        if fmt == "<?":
            return struct.pack(fmt, bool(value))
        return struct.pack(fmt, fit(vtype, int(value)))
    return b""  # an unknown type: no payload the reader could know the size of


def kv(key: str | bytes, vtype: int, value: Any) -> bytes:
    return string(key) + u32(vtype) + value_bytes(vtype, value)


@dataclass
class Tensor:
    name: str | bytes
    shape: tuple[int, ...]
    ttype: int = TENSOR_F32
    offset: int | None = None  # None: laid out after the previous one
    n_dims: int | None = None  # None: len(shape)

    def nbytes(self) -> int:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ttype)]
        except (ValueError, KeyError):
            return 0
        elements = 1
        for dim in self.shape:
            elements *= dim
        return elements // block * size


@dataclass
class Spec:
    """A GGUF file as its parts: entries are (key, value type, value)."""

    kvs: list[tuple[str | bytes, int, Any]]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32  # the padding ``build`` uses; general.alignment is an entry
    n_kv: int | None = None  # None: the number of entries
    n_tensors: int | None = None
    extra: list[bytes] = field(default_factory=list)  # raw entries appended to the metadata

    def with_kv(self, key: str, vtype: int, value: Any) -> Spec:
        """A copy with ``key`` set (replaced in place when present, appended if not)."""
        kvs = list(self.kvs)
        for index, (name, _, _) in enumerate(kvs):
            if name == key:
                kvs[index] = (key, vtype, value)
                return replace(self, kvs=kvs)
        return replace(self, kvs=[*kvs, (key, vtype, value)])

    def without(self, key: str) -> Spec:
        return replace(self, kvs=[entry for entry in self.kvs if entry[0] != key])


def build(spec: Spec) -> bytes:
    """The bytes of ``spec``: header, metadata, tensor table, padding, tensor data."""
    n_kv = len(spec.kvs) + len(spec.extra) if spec.n_kv is None else spec.n_kv
    n_tensors = len(spec.tensors) if spec.n_tensors is None else spec.n_tensors
    out = bytearray(b"GGUF" + u32(spec.version) + u64(n_tensors) + u64(n_kv))
    for key, vtype, value in spec.kvs:
        out += kv(key, vtype, value)
    for raw in spec.extra:
        out += raw
    align = max(1, spec.alignment)
    offset = 0
    for tensor in spec.tensors:
        at = offset if tensor.offset is None else tensor.offset
        n_dims = len(tensor.shape) if tensor.n_dims is None else tensor.n_dims
        out += string(tensor.name) + u32(n_dims)
        out += b"".join(u64(dim) for dim in tensor.shape)
        out += u32(tensor.ttype) + u64(at)
        offset = -(-(at + tensor.nbytes()) // align) * align
    out += bytes(-len(out) % align)
    out += bytes(min(offset, DATA_CAP))
    return bytes(out)


def small_model(
    arch: str = "llama",
    *,
    blocks: int = 2,
    embedding: int = 8,
    heads: int = 2,
    context: int = 64,
    vocab: int = 16,
) -> Spec:
    """A llama-shaped model of a few KiB: the keys the summary reads, a token list,
    an embedding and two tensors per block."""
    p = f"{arch}."
    kvs: list[tuple[str | bytes, int, Any]] = [
        ("general.architecture", STRING, arch),
        ("general.name", STRING, "corpus"),
        ("general.file_type", U32, 0),
        (p + "block_count", U32, blocks),
        (p + "context_length", U32, context),
        (p + "embedding_length", U32, embedding),
        (p + "feed_forward_length", U32, embedding * 2),
        (p + "attention.head_count", U32, heads),
        (p + "attention.head_count_kv", U32, heads),
        (p + "attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("tokenizer.ggml.model", STRING, "llama"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, [f"t{i}" for i in range(vocab)])),
        ("tokenizer.ggml.scores", ARRAY, (F32, [0.0] * vocab)),
    ]
    tensors = [Tensor("token_embd.weight", (embedding, vocab))]
    tensors.append(Tensor("output_norm.weight", (embedding,)))
    for block in range(blocks):
        tensors.append(Tensor(f"blk.{block}.attn_norm.weight", (embedding,)))
        tensors.append(Tensor(f"blk.{block}.attn_q.weight", (embedding, embedding)))
    return Spec(kvs=kvs, tensors=tensors)


def recurrent_model() -> Spec:
    """A Mamba-shaped model: its converter writes a head count of 0 ("unused")."""
    spec = small_model("mamba")
    spec = spec.with_kv("mamba.attention.head_count", U32, 0).without(
        "mamba.attention.head_count_kv"
    )
    for key, value in (("conv_kernel", 4), ("inner_size", 16), ("state_size", 16)):
        spec = spec.with_kv(f"mamba.ssm.{key}", U32, value)
    return spec


def per_layer_model() -> Spec:
    """Per-layer head counts (DeciLM-style: a layer without attention has 0 KV heads)."""
    return small_model().with_kv("llama.attention.head_count_kv", ARRAY, (I32, [2, 0]))


def late_architecture_model() -> Spec:
    """general.architecture written after the keys it names."""
    spec = small_model()
    first, rest = spec.kvs[0], spec.kvs[1:]
    return replace(spec, kvs=[*rest, first])


def split_parts(stem: str = "big", count: int = 2, **changes: Any) -> dict[str, bytes]:
    """A model split into ``count`` parts the way gguf-split writes them: the whole
    metadata in the first, the tensors spread over all. ``changes`` maps a part number
    (``part1``...) to a function editing that part's Spec."""
    whole = small_model(blocks=max(2, count))
    shares: list[list[Tensor]] = [[] for _ in range(count)]
    for index, tensor in enumerate(whole.tensors):
        shares[index % count].append(tensor)
    files = {}
    for number in range(1, count + 1):
        split_keys: list[tuple[str | bytes, int, Any]] = [
            ("split.no", U16, number - 1),
            ("split.count", U16, count),
            ("split.tensors.count", I32, len(whole.tensors)),
        ]
        kvs = whole.kvs + split_keys if number == 1 else split_keys
        spec = Spec(kvs=kvs, tensors=shares[number - 1])
        edit: Callable[[Spec], Spec] | None = changes.get(f"part{number}")
        if edit is not None:
            spec = edit(spec)
        files[f"{stem}-{number:05d}-of-{count:05d}.gguf"] = build(spec)
    return files


@dataclass(frozen=True)
class Case:
    """One hostile input: the files to write, the one to read, the refusal's pattern."""

    files: dict[str, bytes]
    read: str
    match: str  # a regular expression the GgufInvalid message must match

    @property
    def size(self) -> int:
        return sum(len(data) for data in self.files.values())


def _one(data: bytes, match: str, name: str = "m.gguf") -> Case:
    return Case(files={name: data}, read=name, match=match)


def _patched(data: bytes, at: int, raw: bytes) -> bytes:
    return data[:at] + raw + data[at + len(raw) :]


def _array_head(key: str, item_type: int, count: int) -> bytes:
    """An array entry that claims ``count`` items and holds none."""
    return string(key) + u32(ARRAY) + u32(item_type) + u64(count)


def _with_tensor(spec: Spec, index: int, **changes: Any) -> Spec:
    tensors = list(spec.tensors)
    tensors[index] = replace(tensors[index], **changes)
    return replace(spec, tensors=tensors)


def _regressions() -> dict[str, Case]:
    base = small_model()
    data = build(base)
    size = len(data)
    key_at = 24  # the first metadata key's length field
    last = len(base.tensors) - 1
    return {
        # n_kv and n_tensors beyond what the file can hold.
        "n_kv_huge": _one(build(replace(base, n_kv=2**60)), r"metadata entries cannot fit"),
        "n_kv_one_more": _one(build(replace(base, n_kv=len(base.kvs) + 1)), r"\S"),
        "n_tensors_huge": _one(build(replace(base, n_tensors=2**40)), r"tensors cannot fit"),
        "n_both_just_too_many": _one(
            build(replace(base, n_kv=(size - 24) * 6 // 140, n_tensors=(size - 24) * 6 // 330)),
            r"metadata entries and \d+ tensors need at least",
        ),
        # A string whose length runs past the end of the file.
        "key_length_huge": _one(_patched(data, key_at, u64(2**63)), r"metadata key #0 .*claims"),
        "key_length_past_end": _one(
            _patched(data, key_at, u64(size)), r"metadata key #0 at byte 32 needs"
        ),
        "string_value_past_end": _one(
            build(
                replace(
                    base.without("general.name"),
                    tensors=[],
                    extra=[string("general.name") + u32(STRING) + u64(1 << 20)],
                )
            ),
            r"general.name at byte \d+ needs 1048576 bytes",
        ),
        "token_string_past_end": _one(_token_past_end(base), r"tokenizer.ggml.tokens\[3\]"),
        # An array length that overflows (count * item size wraps in 64 bits).
        "array_count_wraps": _one(
            build(replace(base, extra=[_array_head("x.values", U64, 2**61)])),
            r"x.values: array of 2305843009213693952 items \(limit",
        ),
        "array_count_past_end": _one(
            build(replace(base, extra=[_array_head("x.values", U32, 2**23)])),
            r"x.values array at byte \d+ needs 33554432 bytes",
        ),
        "string_array_count_past_end": _one(
            build(replace(base, extra=[_array_head("x.words", STRING, 2**22)])),
            r"x.words array at byte \d+ needs",
        ),
        "nested_array": _one(
            build(base.with_kv("x.nested", ARRAY, (ARRAY, []))),
            r"x.nested: arrays of arrays are not supported",
        ),
        # n_dims above GGML_MAX_DIMS.
        "n_dims_five": _one(
            build(_with_tensor(base, 0, shape=(8, 16, 1, 1, 1))), r"n_dims is 5; a ggml tensor"
        ),
        "n_dims_huge": _one(
            build(_with_tensor(base, 0, n_dims=2**32 - 1)), r"n_dims is 4294967295"
        ),
        # A shape whose element count overflows 64 bits (in C it wraps to something small).
        "shape_product_overflows": _one(
            build(_with_tensor(base, 0, shape=(2**32, 2**32, 4))),
            r"tensor token_embd.weight: shape \[4294967296, 4294967296, 4\] .*overflows 64 bits",
        ),
        "shape_dimension_above_int64": _one(
            build(_with_tensor(base, 1, shape=(2**63,))), r"output_norm.weight: .*overflows"
        ),
        # Tensor data (offset + size) past the end of the file.
        "tensor_offset_past_end": _one(
            build(_with_tensor(base, last, offset=2**40)), r"blk.1.attn_q.weight: data at offset"
        ),
        "tensor_end_past_end": _one(
            build(_with_tensor(base, last, shape=(8, 8 * 64)))[:-1000],
            r"blk.1.attn_q.weight: data at offset \d+ \(ends at \d+\) lies outside the file",
        ),
        "tensor_data_claimed_twice": _one(
            # Every tensor at offset 0: each fits, together they claim more than the file.
            build(replace(base, tensors=[replace(t, offset=0) for t in base.tensors])) + bytes(256),
            r"the tensors claim \d+ bytes of data but the file holds",
        ),
        "tensor_type_unknown": _one(
            build(_with_tensor(base, 0, ttype=99)), r"token_embd.weight: type 99 is not"
        ),
        "tensor_name_too_long": _one(
            build(_with_tensor(base, 0, name="n" * 64)), r"tensor name #0 .*claims 64 bytes"
        ),
        # general.alignment 0, not a power of two, absurd.
        "alignment_zero": _one(
            build(base.with_kv("general.alignment", U32, 0)), r"general.alignment 0 is not"
        ),
        "alignment_three": _one(
            build(base.with_kv("general.alignment", U32, 3)), r"general.alignment 3 is not"
        ),
        "alignment_2_31": _one(
            build(base.with_kv("general.alignment", U32, 2**31)),
            r"general.alignment 2147483648 is not a power of two from 1 to",
        ),
        "alignment_string": _one(
            build(base.with_kv("general.alignment", STRING, "32")),
            r"general.alignment a string is not",
        ),
        # A value type the format does not have.
        "unknown_value_type": _one(
            build(replace(base, extra=[string("x.odd") + u32(99) + u32(0)])),
            r"x.odd: unknown value type 99",
        ),
        "unknown_array_item_type": _one(
            build(replace(base, extra=[string("x.odd") + u32(ARRAY) + u32(77) + u64(1)])),
            r"x.odd array: unknown value type 77",
        ),
        # A key given twice (later readers would take either value).
        "duplicate_key": _one(
            build(replace(base, extra=[kv("llama.block_count", U32, 99)])),
            r"metadata key llama.block_count is given twice",
        ),
        # Too small to hold even the header.
        "four_byte_gguf": _one(b"GGUF", r"4 bytes is too small for a GGUF header"),
        "empty_file": _one(b"", r"0 bytes is too small"),
        "not_gguf": _one(b"GGML" + data[4:], r"not a GGUF file"),
        "version_one": _one(data[:4] + u32(1) + data[8:], r"GGUF version 1 is not supported"),
        "invalid_utf8_key": _one(
            build(replace(base, extra=[kv(b"x.\xff\xfe", U8, 1)])), r"metadata key #\d+ .*UTF-8"
        ),
    }


def _token_past_end(base: Spec) -> bytes:
    """tokenizer.ggml.tokens as the last entry, its fourth string running off the end."""
    tokens = next(entry for entry in base.kvs if entry[0] == "tokenizer.ggml.tokens")
    spec = replace(
        base, kvs=[e for e in base.kvs if e[0] != "tokenizer.ggml.tokens"] + [tokens], tensors=[]
    )
    data = build(spec)
    marker = string("t3")
    at = data.rindex(marker)
    return _patched(data, at, u64(1 << 20))


def _semantic() -> dict[str, Case]:
    base = small_model()
    p = "llama."
    split = split_parts
    return {
        "empty_key": _one(
            build(replace(base, extra=[kv("", U32, 1)])),
            r"metadata key #13 at byte \d+ is empty",
        ),
        "duplicate_tensor_name": _one(
            build(_with_tensor(base, 3, name="blk.0.attn_norm.weight")),
            r"tensor name blk.0.attn_norm.weight is given twice",
        ),
        "empty_tensor_name": _one(
            build(_with_tensor(base, 2, name="")), r"tensor name #2 at byte \d+ is empty"
        ),
        "split_count_absurd": _one(
            build(base.with_kv("split.count", U16, 65535)), r"split.count 65535 is absurd"
        ),
        "split_count_zero": _one(
            build(base.with_kv("split.count", U16, 0)), r"split.count 0 is absurd"
        ),
        "split_count_without_parts_in_name": _one(
            build(base.with_kv("split.count", U16, 3)),
            r"split.count is 3 but the file name says 1 parts",
        ),
        "split_count_not_the_name_s": Case(
            files={
                name.replace("-of-00002", "-of-00003"): data
                for name, data in split("big", 2).items()
            },
            read="big-00001-of-00003.gguf",
            match=r"split.count is 2 but the file name says 3 parts",
        ),
        "split_name_without_split_count": _one(
            build(base), r"split.count is absent but the file name says 2", "x-00001-of-00002.gguf"
        ),
        "split_part_missing": Case(
            files={k: v for k, v in split("big", 3).items() if "00002-of" not in k},
            read="big-00001-of-00003.gguf",
            match=r"split part big-00002-of-00003.gguf of 3 is missing",
        ),
        "split_part_number_wrong": Case(
            files=split("big", 2, part2=lambda s: s.with_kv("split.no", U16, 0)),
            read="big-00001-of-00002.gguf",
            match=r"big-00002-of-00002.gguf: split.no is 0 but this file is part 2 of 2",
        ),
        "split_part_count_wrong": Case(
            files=split("big", 2, part2=lambda s: s.with_kv("split.count", U16, 5)),
            read="big-00001-of-00002.gguf",
            match=r"big-00002-of-00002.gguf: split.count is 5 but the first part says 2",
        ),
        "split_tensor_total_wrong": Case(
            files=split("big", 2, part1=lambda s: s.with_kv("split.tensors.count", I32, 99)),
            read="big-00001-of-00002.gguf",
            match=r"split.tensors.count is 99 but the parts hold 6 tensors",
        ),
        "split_tensor_in_two_parts": Case(
            files=split("big", 2, part2=lambda s: _with_tensor(s, 0, name="token_embd.weight")),
            read="big-00001-of-00002.gguf",
            match=r"tensor name token_embd.weight is given twice, in big-00001-of-00002.gguf "
            r"and big-00002-of-00002.gguf",
        ),
        "split_later_part_read": Case(
            files=split("big", 2),
            read="big-00002-of-00002.gguf",
            match=r"is part 2 of 2; read the first part",
        ),
        "block_count_beyond_tensors": _one(
            build(base.with_kv(p + "block_count", U32, 1000)),
            r"llama.block_count is 1000 but the file holds only 6 tensors",
        ),
        "block_count_zero": _one(
            build(base.with_kv(p + "block_count", U32, 0)), r"llama.block_count is 0"
        ),
        "context_length_zero": _one(
            build(base.with_kv(p + "context_length", U32, 0)),
            r"llama.context_length is 0; a model needs at least 1",
        ),
        "context_length_negative": _one(
            build(base.with_kv(p + "context_length", I32, -4096)),
            r"llama.context_length is -4096",
        ),
        "context_length_beyond_int64": _one(
            build(base.with_kv(p + "context_length", U64, 2**64 - 1)),
            r"llama.context_length is 18446744073709551615, beyond 2\^63 - 1",
        ),
        "head_count_zero": _one(
            build(base.with_kv(p + "attention.head_count", U32, 0)),
            r"llama.attention.head_count is 0; a model needs at least 1",
        ),
        "head_count_negative": _one(
            build(base.with_kv(p + "attention.head_count", I32, -2)),
            r"llama.attention.head_count is -2",
        ),
        "head_count_kv_zero": _one(
            build(base.with_kv(p + "attention.head_count_kv", U32, 0)),
            r"llama.attention.head_count_kv is 0",
        ),
        "head_count_per_layer_all_zero": _one(
            build(base.with_kv(p + "attention.head_count", ARRAY, (U32, [0, 0]))),
            r"llama.attention.head_count is 0",
        ),
        "block_count_a_string": _one(
            build(base.with_kv(p + "block_count", STRING, "32")),
            r"llama.block_count is a string, not an integer",
        ),
        "context_length_a_float": _one(
            build(base.with_kv(p + "context_length", F32, 4096.0)),
            r"llama.context_length is a float, not an integer",
        ),
        "kv_cache_product_overflows": _one(
            build(base.with_kv(p + "context_length", U64, 2**62)),
            r"llama.context_length \* block_count \* attention.head_count_kv .* overflows 64",
        ),
        "embedding_product_overflows": _one(
            build(
                base.with_kv(p + "embedding_length", U64, 2**62)
                .with_kv(p + "attention.key_length", U32, 4)
                .with_kv(p + "attention.value_length", U32, 4)
            ),
            r"llama.embedding_length \* vocab_size = \d+ overflows 64 bits",
        ),
        "architecture_not_a_string": _one(
            build(base.with_kv("general.architecture", U32, 7)),
            r"general.architecture is an integer, not a string",
        ),
        "tokens_not_strings": _one(
            build(base.with_kv("tokenizer.ggml.tokens", ARRAY, (U32, [1, 2]))),
            r"tokenizer.ggml.tokens is an array of 2 uint32, not an array of strings",
        ),
    }


def accepted() -> dict[str, Case]:
    """Valid headers every rule must let through (``match`` unused)."""
    return {
        "small_model": _one(build(small_model()), ""),
        "recurrent_head_count_zero": _one(build(recurrent_model()), ""),
        "per_layer_head_count_kv": _one(build(per_layer_model()), ""),
        "architecture_written_last": _one(build(late_architecture_model()), ""),
        "split_in_three": Case(
            files=split_parts("big", 3), read="big-00001-of-00003.gguf", match=""
        ),
    }


REGRESSIONS = _regressions()
SEMANTIC = _semantic()
