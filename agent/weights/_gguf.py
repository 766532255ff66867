"""A bounded GGUF header reader: hostile files get one clear error, never a hang.

The ``gguf`` package's reader trusts the file (huge counts make it run for a
very long time, some offsets read past the end without complaint), so the
agent parses the header itself, using the package only for its constants,
under hard limits: every length and count must fit in what is left of the
file and under a fixed ceiling, tensor data must lie inside the file, the
alignment must be a power of two, no key or tensor name is given twice, and
the whole parse has a deadline. Any violation is :class:`GgufInvalid`
(answered ``422 gguf_invalid``) naming the field.

Memory stays below the file's own size: the file is mapped, not read; only the
keys the summary reads are kept (``_gguf_checks.GENERAL_KEYS`` and the
architecture's ``ARCH_KEYS``), arrays are walked and counted, and each entry
costs a fixed few bytes (8 per key for the duplicate check, 24 per tensor)
where the file spends at least 14 per key and 33 per tensor. The semantic
rules (a header that parses but cannot be a model) are ``_gguf_checks``;
:func:`read_summary` applies them before anyone estimates from the summary.
"""

from __future__ import annotations

import mmap
import struct
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType

from agent.weights._gguf_checks import (
    ARCH_KEYS,
    GENERAL_KEYS,
    ArrayInfo,
    GgufInvalid,
    check_model,
    check_part,
    check_split_tensors,
    describe,
    is_model_file,
    show,
    split_parts,
)

__all__ = ["GgufInvalid", "Header", "is_model_file", "read_header", "read_summary", "summary"]

MAGIC = b"GGUF"
PREAMBLE = 24  # magic, version, tensor count, metadata count
MAX_KV = 100_000
MAX_TENSORS = 1_000_000
MAX_KEY = 65_535  # the GGUF specification's limit on a key
MAX_STRING = 16 * 1024 * 1024
MAX_ARRAY = 16 * 1024 * 1024
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # GGML_MAX_NAME, less its terminating NUL
MAX_ALIGNMENT = 1 << 20
MAX_ELEMENTS = 2**63 - 1  # ggml counts elements in an int64_t
# Integer arrays of a kept key up to this length are summed up as their range (a value
# per layer); longer ones only counted.
MAX_LAYER_ARRAY = 4096
# The fewest bytes an entry can take: a length, a name of one byte, a type, one value
# byte; a tensor: a length, one name byte, n_dims, one dimension, a type, an offset.
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8
DEADLINE_SECONDS = 10.0

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_INTEGER_ITEMS = {t for t in _SCALARS if t.name.startswith(("UINT", "INT"))}
_VALUE_TYPES = {t.value: t for t in GGUFValueType}
_SHAPES = {n: struct.Struct(f"<{n}Q") for n in range(1, MAX_DIMS + 1)}
_TYPE_OFFSET = struct.Struct("<IQ")
# ggml type number: (elements per block, bytes per block, name)
_TENSOR_TYPES = {int(t): (*GGML_QUANT_SIZES[t], t.name) for t in GGML_QUANT_SIZES}


@dataclass
class Header:
    """What the reader keeps of a GGUF: the summary's keys and the tensor table's totals."""

    version: int
    metadata: dict[str, Any]  # only GENERAL_KEYS and the architecture's ARCH_KEYS
    kv_count: int
    tensor_count: int
    tensor_bytes: int
    parameter_count: int
    data_offset: int
    file_size: int
    tensor_table: int  # the byte where the tensor table starts
    # hash() of every tensor name, sorted: the duplicate check across split parts.
    name_hashes: array[int] = field(repr=False)


Label = str | Callable[[], str]  # a message part, built only when a check fails


class _Cursor:
    __slots__ = ("buf", "deadline", "file", "pos", "size")

    def __init__(self, buf: memoryview, size: int, deadline: float, file: str) -> None:
        self.buf, self.size, self.pos, self.deadline, self.file = buf, size, 0, deadline, file

    def fail(self, message: str) -> NoReturn:
        raise GgufInvalid(f"{self.file}: {message}")

    def need(self, n: int, what: Label) -> None:
        if self.pos + n > self.size:
            label = what if isinstance(what, str) else what()
            self.fail(
                f"{label} at byte {self.pos} needs {n} bytes but the file ends at {self.size}"
            )

    def in_time(self, what: Label) -> None:
        if time.monotonic() > self.deadline:
            label = what if isinstance(what, str) else what()
            self.fail(f"parsing took longer than {DEADLINE_SECONDS:.0f} s (at {label})")

    def unpack(self, fmt: struct.Struct, what: Label) -> Any:
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def vtype(self, kind: int, what: Label) -> GGUFValueType:
        found = _VALUE_TYPES.get(kind)
        if found is None:
            label = what if isinstance(what, str) else what()
            self.fail(f"{label}: unknown value type {kind}")
        return found

    def name(self, kind: str, index: int, limit: int) -> str:
        """A key or tensor name: UTF-8, not empty, at most ``limit`` bytes."""
        at = self.pos
        if at + 8 > self.size:
            self.need(8, f"{kind} #{index} length")
        (length,) = _U64.unpack_from(self.buf, at)
        if length > limit:
            self.fail(f"{kind} #{index} at byte {at} claims {length} bytes (limit {limit})")
        if not length:
            self.fail(f"{kind} #{index} at byte {at} is empty; every key and tensor has a name")
        self.pos = start = at + 8
        if start + length > self.size:
            self.need(length, f"{kind} #{index}")
        try:
            found = str(self.buf[start : start + length], "utf-8")
        except UnicodeDecodeError:
            self.fail(f"{kind} #{index} at byte {at} is not UTF-8")
        self.pos = start + length
        return found

    def string(self, key: str) -> str:
        """A kept string value."""
        at = self.pos
        length = self.unpack(_U64, lambda: f"{show(key)} length")
        if length > MAX_STRING:
            self.fail(f"{show(key)} at byte {at} claims {length} bytes (limit {MAX_STRING})")
        self.need(length, lambda: show(key))
        try:
            found = str(self.buf[self.pos : self.pos + length], "utf-8")
        except UnicodeDecodeError:
            self.fail(f"{show(key)} at byte {at} is not UTF-8")
        self.pos += length
        return found

    def skip_strings(self, count: int, key: str) -> None:
        """Walk ``count`` strings without decoding them (tokenizer arrays are long)."""
        self.need(count * 8, lambda: f"{show(key)} array")  # at least a length per item
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        for index in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{show(key)}[{index}] length")
            (length,) = unpack(buf, pos)
            if pos + 8 + length > size:
                self.pos = pos
                self.fail(
                    f"{show(key)}[{index}] at byte {pos} claims {length} bytes but the file "
                    f"ends at {size}"
                )
            pos += 8 + length
            if not index & 0xFFFF:
                self.in_time(lambda: show(key))
        self.pos = pos

    def value(self, kind: int, key: str, keep: bool) -> Any:
        """The value of ``key`` (None when not kept); arrays come back as ArrayInfo."""
        label = lambda: show(key)  # noqa: E731 (a message part, built only on failure)
        vtype = self.vtype(kind, label)
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            if keep:
                return self.unpack(scalar, label)
            self.need(scalar.size, label)
            self.pos += scalar.size
            return None
        if vtype == GGUFValueType.STRING:
            if keep:
                return self.string(key)
            length = self.unpack(_U64, lambda: f"{show(key)} length")
            self.need(length, label)
            self.pos += length
            return None
        item_type = self.vtype(
            self.unpack(_U32, lambda: f"{show(key)} array type"), lambda: f"{show(key)} array"
        )
        count = self.unpack(_U64, lambda: f"{show(key)} array length")
        if count > MAX_ARRAY:
            self.fail(f"{show(key)}: array of {count} items (limit {MAX_ARRAY})")
        if item_type == GGUFValueType.ARRAY:
            self.fail(f"{show(key)}: arrays of arrays are not supported (llama.cpp refuses them)")
        if item_type == GGUFValueType.STRING:
            self.skip_strings(count, key)
            return ArrayInfo(item_type, count) if keep else None
        item = _SCALARS[item_type]
        total = count * item.size
        self.need(total, lambda: f"{show(key)} array")  # the whole array must be in the file
        info = None
        if keep:
            low = high = None
            if item_type in _INTEGER_ITEMS and 0 < count <= MAX_LAYER_ARRAY:
                for (number,) in item.iter_unpack(self.buf[self.pos : self.pos + total]):
                    low = number if low is None else min(low, number)
                    high = number if high is None else max(high, number)
            info = ArrayInfo(item_type, count, low, high)
        self.pos += total
        return info


def _kvs(cur: _Cursor, count: int, keep: Callable[[str], bool]) -> Iterator[tuple[str, Any]]:
    """Each metadata entry as (key, value or None when not kept)."""
    for index in range(count):
        key = cur.name("metadata key", index, MAX_KEY)
        if cur.pos + 4 > cur.size:
            cur.need(4, f"{show(key)} value type")
        (kind,) = _U32.unpack_from(cur.buf, cur.pos)
        cur.pos += 4
        yield key, cur.value(kind, key, keep(key))
        if not index & 0xFF:
            cur.in_time("metadata")


def _tensors(cur: _Cursor, count: int) -> Iterator[tuple[str, tuple[int, ...], int, int]]:
    """Each tensor-table entry as (name, shape, ggml type, offset)."""
    buf, size = cur.buf, cur.size
    for index in range(count):
        name = cur.name("tensor name", index, MAX_NAME)
        at = cur.pos
        if at + 4 > size:
            cur.need(4, f"tensor {show(name)} n_dims")
        (n_dims,) = _U32.unpack_from(buf, at)
        if not 1 <= n_dims <= MAX_DIMS:
            cur.fail(f"tensor {show(name)}: n_dims is {n_dims}; a ggml tensor has 1 to {MAX_DIMS}")
        end = at + 4 + 8 * n_dims + _TYPE_OFFSET.size
        if end > size:
            cur.pos = at + 4
            cur.need(end - at - 4, f"tensor {show(name)} shape, type and offset")
        shape = _SHAPES[n_dims].unpack_from(buf, at + 4)
        ttype, offset = _TYPE_OFFSET.unpack_from(buf, end - _TYPE_OFFSET.size)
        cur.pos = end
        yield name, shape, ttype, offset
        if not index & 0xFF:
            cur.in_time("the tensor table")


def _duplicated(hashes: array[int]) -> list[int]:
    """The hash values present more than once; sorts ``hashes`` in place, no copy."""
    if len(hashes) < 2:
        return []
    view = np.frombuffer(hashes, dtype=np.int64)
    view.sort()
    same = view[1:] == view[:-1]
    found = [int(h) for h in view[1:][same]] if same.any() else []
    del view, same  # the array's buffer stays exported while a view lives
    return found


def _twice(names: Iterator[str], wanted: list[int]) -> str | None:
    """The first name seen twice among those whose hash is wanted (a hash collision of
    two different names is no duplicate)."""
    targets = set(wanted)
    seen: set[str] = set()
    for name in names:
        if hash(name) in targets:
            if name in seen:
                return name
            seen.add(name)
    return None


def _check_counts(n_kv: int, n_tensors: int, size: int, fail: Callable[[str], NoReturn]) -> None:
    if n_kv > MAX_KV or PREAMBLE + n_kv * MIN_KV_BYTES > size:
        fail(f"{n_kv} metadata entries cannot fit in {size} bytes (limit {MAX_KV})")
    if n_tensors > MAX_TENSORS or PREAMBLE + n_tensors * MIN_TENSOR_BYTES > size:
        fail(f"{n_tensors} tensors cannot fit in {size} bytes (limit {MAX_TENSORS})")
    least = PREAMBLE + n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_BYTES
    if least > size:
        fail(
            f"{n_kv} metadata entries and {n_tensors} tensors need at least {least} bytes; "
            f"the file has {size}"
        )


@contextmanager
def _mapped(path: Path) -> Iterator[tuple[memoryview, int]]:
    """The file mapped read-only; the size is the mapping's, not an earlier stat's."""
    try:
        handle = open(path, "rb", buffering=0)  # no read buffer: the file is mapped
    except OSError as exc:
        raise GgufInvalid(f"{path.name}: cannot be read ({exc.strerror})") from None
    with handle:
        try:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # ValueError: an empty file
            mapped = None
        if mapped is None or len(mapped) < PREAMBLE:
            size = 0 if mapped is None else len(mapped)
            if mapped is not None:
                mapped.close()
            raise GgufInvalid(f"{path.name}: {size} bytes is too small for a GGUF header")
        with mapped:
            view = memoryview(mapped)
            try:
                yield view, len(mapped)
            finally:
                view.release()


def read_header(path: Path) -> Header:
    """Parse and bound-check a GGUF file's header and tensor table."""
    with _mapped(path) as (view, size):
        return _parse(view, size, path.name)


def _parse(view: memoryview, size: int, file: str) -> Header:
    cur = _Cursor(view, size, time.monotonic() + DEADLINE_SECONDS, file)
    if bytes(view[:4]) != MAGIC:
        cur.fail(f"not a GGUF file (magic {bytes(view[:4])!r})")
    cur.pos = 4
    version = cur.unpack(_U32, "version")
    if version not in (2, 3):
        cur.fail(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors = cur.unpack(_U64, "tensor count")
    n_kv = cur.unpack(_U64, "metadata count")
    _check_counts(n_kv, n_tensors, size, cur.fail)
    metadata = _read_metadata(cur, n_kv)
    alignment = metadata.get("general.alignment", 32)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or not 1 <= alignment <= MAX_ALIGNMENT
        or alignment & (alignment - 1)
    ):
        said = alignment if isinstance(alignment, int) else describe(alignment)
        cur.fail(f"general.alignment {said} is not a power of two from 1 to {MAX_ALIGNMENT}")

    table = cur.pos
    hashes = array("q", [0]) * n_tensors
    offsets = array("Q", [0]) * n_tensors
    lengths = array("Q", [0]) * n_tensors
    params = total = 0
    for index, (name, shape, ttype, offset) in enumerate(_tensors(cur, n_tensors)):
        hashes[index] = hash(name)
        kind = _TENSOR_TYPES.get(ttype)
        if kind is None:
            cur.fail(f"tensor {show(name)}: type {ttype} is not a ggml type")
        block, type_size, type_name = kind
        elements = 1
        for dim in shape:
            elements *= dim
        if elements > MAX_ELEMENTS or max(shape) > MAX_ELEMENTS:
            cur.fail(
                f"tensor {show(name)}: shape {list(shape)} has {elements} elements; the product "
                "overflows 64 bits"
            )
        if shape[0] % block:
            cur.fail(
                f"tensor {show(name)}: its first dimension {shape[0]} is not a whole number "
                f"of {type_name} blocks ({block} elements)"
            )
        nbytes = elements // block * type_size
        if offset > size or nbytes > size:
            cur.fail(
                f"tensor {show(name)}: data at offset {offset} of {nbytes} bytes lies outside "
                f"the file ({size} bytes)"
            )
        offsets[index], lengths[index] = offset, nbytes
        params += elements
        total += nbytes
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    for index in range(n_tensors):
        end = data_offset + offsets[index] + lengths[index]
        if offsets[index] % alignment or end > size:
            name = next(
                n for i, (n, *_) in enumerate(_tensors(_at(cur, table), n_tensors)) if i == index
            )
            cur.fail(
                f"tensor {show(name)}: data at offset {offsets[index]} (ends at {end}) lies "
                f"outside the file ({size} bytes) or is not a multiple of general.alignment "
                f"{alignment}"
            )
    if data_offset + total > size:
        cur.fail(
            f"the tensors claim {total} bytes of data but the file holds "
            f"{max(0, size - data_offset)} after its header"
        )
    del offsets, lengths
    duplicated = _duplicated(hashes)
    if duplicated:
        twice = _twice((n for n, *_ in _tensors(_at(cur, table), n_tensors)), duplicated)
        if twice is not None:
            cur.fail(f"tensor name {show(twice)} is given twice; a tensor name names one tensor")
    return Header(
        version=version,
        metadata=metadata,
        kv_count=n_kv,
        tensor_count=n_tensors,
        tensor_bytes=total,
        parameter_count=params,
        data_offset=data_offset,
        file_size=size,
        tensor_table=table,
        name_hashes=hashes,
    )


def _at(cur: _Cursor, pos: int) -> _Cursor:
    """A second cursor over the same file, to walk a table again (error paths)."""
    again = _Cursor(cur.buf, cur.size, cur.deadline, cur.file)
    again.pos = pos
    return again


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    """The kept keys of the metadata, after checking every entry and that no key is
    given twice."""
    start = cur.pos
    metadata: dict[str, Any] = {}
    arch_keys: frozenset[str] = frozenset()
    arch_index = 0
    hashes = array("q", [0]) * n_kv

    def keep(key: str) -> bool:
        return key in GENERAL_KEYS or key in arch_keys

    for index, (key, value) in enumerate(_kvs(cur, n_kv, keep)):
        hashes[index] = hash(key)
        if value is None:
            continue
        metadata.setdefault(key, value)
        if key == "general.architecture" and isinstance(value, str) and not arch_keys:
            arch_keys = frozenset(f"{value}.{k}" for k in ARCH_KEYS)
            arch_index = index
    if arch_index:  # the architecture came late: its keys before it were not kept
        for key, value in _kvs(_at(cur, start), arch_index, arch_keys.__contains__):
            if value is not None:
                metadata.setdefault(key, value)
    duplicated = _duplicated(hashes)
    if duplicated:
        twice = _twice((k for k, _ in _kvs(_at(cur, start), n_kv, lambda _: False)), duplicated)
        if twice is not None:
            cur.fail(f"metadata key {show(twice)} is given twice; a key names one value")
    return metadata


def summary(header: Header) -> dict[str, Any]:
    """The header summary of docs/agent-api.md, "GET /agent/v1/folders/{folder}/gguf"."""
    md = header.metadata
    found = md.get("general.architecture")
    arch = found if isinstance(found, str) else ""

    def number(key: str) -> int | None:
        value = md.get(f"{arch}.{key}")
        if isinstance(value, ArrayInfo):  # one value per layer: the largest
            return value.high
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    tokens = md.get("tokenizer.ggml.tokens")
    head_count = number("attention.head_count")
    embedding = number("embedding_length")
    default_head = embedding // head_count if embedding and head_count else None
    causal = md.get(f"{arch}.attention.causal")
    split_count = md.get("split.count")
    file_type = md.get("general.file_type")
    return {
        "architecture": arch,
        "ggufVersion": header.version,
        "parameterCount": header.parameter_count,
        "fileType": file_type if isinstance(file_type, int) else None,
        "blockCount": number("block_count"),
        "contextLength": number("context_length"),
        "embeddingLength": embedding,
        "headCount": head_count,
        "headCountKv": number("attention.head_count_kv") or head_count,
        "keyLength": number("attention.key_length") or default_head,
        "valueLength": number("attention.value_length") or default_head,
        "vocabSize": tokens.count if isinstance(tokens, ArrayInfo) else number("vocab_size"),
        "poolingType": number("pooling_type"),
        "causalAttention": causal if isinstance(causal, bool) else True,
        "tensorBytes": header.tensor_bytes,
        "fileSize": header.file_size,
        "splitCount": split_count if isinstance(split_count, int) else 1,
        # Hybrid (attention + SSM) models: the estimate needs these for the SSM state.
        "fullAttentionInterval": number("full_attention_interval"),
        "ssmConvKernel": number("ssm.conv_kernel"),
        "ssmInnerSize": number("ssm.inner_size"),
        "ssmStateSize": number("ssm.state_size"),
        "ssmGroupCount": number("ssm.group_count"),
    }


def read_summary(path: Path) -> dict[str, Any]:
    """The summary of a GGUF, with the tensor data of every split part added up.

    llama.cpp is given the first part and loads the others itself, so the
    estimate's weights term is the sum over ``name-0000i-of-0000N.gguf``; a part
    that is missing is reported, not silently counted as zero. The header must
    also be able to describe a model (``_gguf_checks``): this runs before any
    estimate is computed from the summary.
    """
    first = read_header(path)
    parts = split_parts(first.metadata, file=path.name)
    tensors, data = first.tensor_count, first.tensor_bytes
    if len(parts) > 1:
        hashes = array("q", first.name_hashes)
        tables = [(path, first.tensor_table, first.tensor_count)]
        for index, name in enumerate(parts[1:], start=2):
            part = path.with_name(name)
            if not part.is_file():
                raise GgufInvalid(f"{path.name}: split part {name} of {len(parts)} is missing")
            header = read_header(part)
            check_part(header.metadata, file=name, count=len(parts), index=index)
            tensors += header.tensor_count
            data += header.tensor_bytes
            hashes.extend(header.name_hashes)
            tables.append((part, header.tensor_table, header.tensor_count))
        duplicated = _duplicated(hashes)
        if duplicated:
            _refuse_duplicate_across(path.name, tables, duplicated)
    check_split_tensors(first.metadata, file=path.name, total=tensors)
    check_model(first.metadata, file=path.name, tensor_count=tensors)
    out = summary(first)
    out["parts"] = parts
    out["tensorBytesAllParts"] = data
    return out


def _refuse_duplicate_across(
    file: str, tables: list[tuple[Path, int, int]], wanted: list[int]
) -> None:
    """Name the tensor that two split parts both hold, if one does (hashes can collide)."""
    targets = set(wanted)
    holders: dict[str, str] = {}
    for path, table, count in tables:
        with _mapped(path) as (view, size):
            cur = _Cursor(view, size, time.monotonic() + DEADLINE_SECONDS, path.name)
            cur.pos = table
            for name, *_ in _tensors(cur, count):
                if hash(name) not in targets:
                    continue
                if name in holders:
                    raise GgufInvalid(
                        f"{file}: tensor name {show(name)} is given twice, in "
                        f"{holders[name]} and {path.name}; a tensor name names one tensor"
                    )
                holders[name] = path.name
