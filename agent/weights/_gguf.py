"""A bounded GGUF header reader: hostile files get one clear error, never a hang.

The ``gguf`` package's reader trusts the file (huge counts make it run for a
very long time, some offsets read past the end without complaint), so the
agent parses the header itself, using the package only for its constants,
under hard limits: every length and count must fit in what is left of the
file and under a fixed ceiling, tensor data must lie inside the file, the
alignment must be a power of two, and the whole parse has a deadline. Any
violation is :class:`GgufInvalid` (answered ``422 gguf_invalid``).
"""

from __future__ import annotations

import mmap
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from agent._errors import ApiError
from protocol.errors import AgentCode

MAGIC = b"GGUF"
MAX_KV = 100_000
MAX_TENSORS = 1_000_000
MAX_STRING = 16 * 1024 * 1024
MAX_ARRAY = 16 * 1024 * 1024
MAX_DIMS = 8
DEADLINE_SECONDS = 10.0

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Arrays we keep whole (small, needed by the summary); others are only counted.
_KEEP_ARRAYS = ("tokenizer.ggml.tokens",)


class GgufInvalid(ApiError):
    code = AgentCode.GGUF_INVALID
    status = 422


@dataclass
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[dict[str, Any]]
    data_offset: int
    file_size: int


class _Cursor:
    def __init__(self, buf: memoryview, size: int, deadline: float) -> None:
        self.buf, self.size, self.pos, self.deadline = buf, size, 0, deadline

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GgufInvalid(
                f"{what} at byte {self.pos} needs {n} bytes but the file ends at {self.size}"
            )
        if time.monotonic() > self.deadline:
            raise GgufInvalid(f"parsing took longer than {DEADLINE_SECONDS:.0f} s")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.unpack("<Q", f"{what} length")
        if length > MAX_STRING:
            raise GgufInvalid(f"{what} claims {length} bytes (limit {MAX_STRING})")
        self.need(length, what)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufInvalid(f"{what} is not UTF-8") from None

    def value(self, kind: int, key: str, keep: bool = True) -> Any:
        try:
            vtype = GGUFValueType(kind)
        except ValueError:
            raise GgufInvalid(f"{key}: unknown value type {kind}") from None
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], key)
        if vtype == GGUFValueType.STRING:
            return self.string(key)
        item_type = self.unpack("<I", f"{key} array type")
        count = self.unpack("<Q", f"{key} array length")
        if count > MAX_ARRAY:
            raise GgufInvalid(f"{key}: array of {count} items (limit {MAX_ARRAY})")
        if item_type in _SCALARS:
            size = struct.calcsize(_SCALARS[GGUFValueType(item_type)])
            self.need(count * size, f"{key} array")  # the whole array must be in the file
            if not keep:
                self.pos += count * size
                return {"count": count}
        elif item_type == GGUFValueType.STRING:
            self.need(count * 8, f"{key} array")  # at least a length per item
        else:
            raise GgufInvalid(f"{key}: arrays of type {item_type} are not supported")
        items = [self.value(item_type, key, keep) for _ in range(count)]
        return items if keep else {"count": count}


def read_header(path: Path) -> Header:
    """Parse and bound-check a GGUF file's header and tensor table."""
    try:
        size = path.stat().st_size
        handle = open(path, "rb")
    except OSError as exc:
        raise GgufInvalid(f"{path.name}: cannot be read ({exc.strerror})") from None
    with handle:
        if size < 24:
            raise GgufInvalid(f"{path.name}: {size} bytes is too small for a GGUF header")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _parse(view, size, path.name)
            finally:
                view.release()


def _parse(view: memoryview, size: int, name: str) -> Header:
    cur = _Cursor(view, size, time.monotonic() + DEADLINE_SECONDS)
    if bytes(view[:4]) != MAGIC:
        raise GgufInvalid(f"{name}: not a GGUF file (magic {bytes(view[:4])!r})")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise GgufInvalid(f"{name}: GGUF version {version} is not supported (2 or 3)")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    if n_kv > MAX_KV or n_kv * 13 > size:  # a key-value pair takes at least 13 bytes
        raise GgufInvalid(f"{name}: {n_kv} metadata entries cannot fit in {size} bytes")
    if n_tensors > MAX_TENSORS or n_tensors * 28 > size:  # a tensor entry takes at least 28
        raise GgufInvalid(f"{name}: {n_tensors} tensors cannot fit in {size} bytes")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        kind = cur.unpack("<I", f"{key} type")
        keep = not key.startswith("tokenizer.") or key in _KEEP_ARRAYS
        metadata[key] = cur.value(kind, key, keep)
    tensors = []
    for _ in range(n_tensors):
        tname = cur.string("tensor name")
        n_dims = cur.unpack("<I", f"{tname} dimensions")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GgufInvalid(f"{name}: tensor {tname} has {n_dims} dimensions")
        dims = [cur.unpack("<Q", f"{tname} shape") for _ in range(n_dims)]
        ttype = cur.unpack("<I", f"{tname} type")
        offset = cur.unpack("<Q", f"{tname} offset")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise GgufInvalid(f"{name}: tensor {tname} has unknown type {ttype}") from None
        elements = 1
        for d in dims:
            elements *= d
        if elements % block:
            raise GgufInvalid(f"{name}: tensor {tname} does not fill whole blocks")
        tensors.append(
            {
                "name": tname,
                "shape": dims,
                "type": ttype,
                "offset": offset,
                "bytes": elements // block * type_size,
            }
        )
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GgufInvalid(f"{name}: general.alignment {alignment!r} is not a power of two")
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    for tensor in tensors:
        end = data_offset + tensor["offset"] + tensor["bytes"]
        if tensor["offset"] % alignment or end > size:
            raise GgufInvalid(
                f"{name}: tensor {tensor['name']} data (ends at {end}) lies outside the file "
                f"({size} bytes) or is misaligned"
            )
    return Header(
        version=version, metadata=metadata, tensors=tensors, data_offset=data_offset, file_size=size
    )


def summary(header: Header) -> dict[str, Any]:
    """The header summary of docs/agent-api.md, "GET /agent/v1/folders/{folder}/gguf"."""
    md = header.metadata
    arch = str(md.get("general.architecture", ""))

    def arch_key(key: str) -> Any:
        return md.get(f"{arch}.{key}")

    tokens = md.get("tokenizer.ggml.tokens")
    head_count = arch_key("attention.head_count")
    embedding = arch_key("embedding_length")
    default_head = embedding // head_count if isinstance(embedding, int) and head_count else None
    return {
        "architecture": arch,
        "ggufVersion": header.version,
        "parameterCount": sum(_elements(t["shape"]) for t in header.tensors),
        "fileType": md.get("general.file_type"),
        "blockCount": arch_key("block_count"),
        "contextLength": arch_key("context_length"),
        "embeddingLength": embedding,
        "headCount": head_count,
        "headCountKv": arch_key("attention.head_count_kv") or head_count,
        "keyLength": arch_key("attention.key_length") or default_head,
        "valueLength": arch_key("attention.value_length") or default_head,
        "vocabSize": len(tokens) if isinstance(tokens, list) else arch_key("vocab_size"),
        "poolingType": arch_key("pooling_type"),
        "causalAttention": arch_key("attention.causal")
        if arch_key("attention.causal") is not None
        else True,
        "tensorBytes": sum(t["bytes"] for t in header.tensors),
        "fileSize": header.file_size,
        "splitCount": md.get("split.count") if isinstance(md.get("split.count"), int) else 1,
        # Hybrid (attention + SSM) models: the estimate needs these for the SSM state.
        "fullAttentionInterval": arch_key("full_attention_interval"),
        "ssmConvKernel": arch_key("ssm.conv_kernel"),
        "ssmInnerSize": arch_key("ssm.inner_size"),
        "ssmStateSize": arch_key("ssm.state_size"),
        "ssmGroupCount": arch_key("ssm.group_count"),
    }


_SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_model_file(name: str) -> bool:
    """A GGUF an instance can be started from: not a projector, not a later split part."""
    if not name.endswith(".gguf") or name.startswith("mmproj-"):
        return False
    match = _SPLIT_RE.match(name)
    return match is None or int(match["index"]) == 1


def read_summary(path: Path) -> dict[str, Any]:
    """The summary of a GGUF, with the tensor data of every split part added up.

    llama.cpp is given the first part and loads the others itself, so the
    estimate's weights term is the sum over ``name-0000i-of-0000N.gguf``; a part
    that is missing is reported, not silently counted as zero.
    """
    first = summary(read_header(path))
    count = first["splitCount"]
    first["parts"] = [path.name]
    first["tensorBytesAllParts"] = first["tensorBytes"]
    match = _SPLIT_RE.match(path.name)
    if count <= 1 or match is None:
        return first
    total = 0
    parts = []
    for index in range(1, count + 1):
        name = f"{match['stem']}-{index:05d}-of-{count:05d}.gguf"
        part = path.with_name(name)
        if not part.is_file():
            raise GgufInvalid(f"{path.name}: split part {name} of {count} is missing")
        total += summary(read_header(part))["tensorBytes"]
        parts.append(name)
    first["parts"] = parts
    first["tensorBytesAllParts"] = total
    return first


def _elements(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
