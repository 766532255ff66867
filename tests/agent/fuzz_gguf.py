"""A fuzzer of the agent's GGUF header reader, for the suite's smoke run and for hours.

    .venv/bin/python -m tests.agent.fuzz_gguf --seconds 600

Every example is a valid tiny GGUF (the demo model of protocol/tinygguf.py, the small
models of tests/agent/gguf_corpus.py) mutated byte by byte in its header, or a header
rebuilt from a mutated structure (entries of any type and value, tensors of any shape,
type, name). ``read_summary`` must answer each with a summary or ``GgufInvalid``, never
another exception, within ``PARSE_LIMIT_S``, its peak traced memory (tracemalloc) at most
the file's size plus ``ALLOWANCE``, the fixed cost of a parse (the error and its
traceback, the summary, a few cursors) whatever the file says. Hypothesis drives it
(atheris 3.1.0 has no wheel for this platform); the figures of a run are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.weights._gguf import GgufInvalid, read_header, read_summary
from agent.weights._gguf_checks import ARCH_KEYS, GENERAL_KEYS
from tests.agent import gguf_corpus as corpus

PARSE_LIMIT_S = 1.0
ALLOWANCE = 16 * 1024
INTERESTING = (
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    12,
    13,
    31,
    32,
    33,
    63,
    64,
    255,
    256,
    4096,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**61,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
)
# The keys the reader acts on (so mutations reach its rules), a stranger and an empty one.
KEYS = (*sorted(GENERAL_KEYS), *(f"llama.{key}" for key in ARCH_KEYS), "x", "")
NAMES = ("token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.9.x", "n" * 64)


@dataclass(frozen=True)
class Seed:
    """Valid files (one model, or the parts of a split one) and where their headers end."""

    name: str
    files: dict[str, bytes]
    read: str  # the file read_summary is given
    header_ends: dict[str, int]  # mutations land before this byte (tensor data is not parsed)


@dataclass
class Figures:
    """What a run measured, over all its examples."""

    examples: int = 0
    accepted: int = 0
    refused: int = 0
    max_parse_s: float = 0.0
    max_peak_over_size: int = 0  # the largest (peak traced bytes - bytes of the files)
    max_peak_bytes: int = 0
    largest_input: int = 0

    def add(self, *, size: int, seconds: float, peak: int, ok: bool) -> None:
        self.examples += 1
        self.accepted += ok
        self.refused += not ok
        self.max_parse_s = max(self.max_parse_s, seconds)
        self.max_peak_over_size = max(self.max_peak_over_size, peak - size)
        self.max_peak_bytes = max(self.max_peak_bytes, peak)
        self.largest_input = max(self.largest_input, size)


def _seed(name: str, files: dict[str, bytes], read: str) -> Seed:
    ends = {}
    with tempfile.TemporaryDirectory() as folder:
        for file, data in files.items():
            (Path(folder) / file).write_bytes(data)
            ends[file] = read_header(Path(folder) / file).data_offset
    return Seed(name, files, read, ends)


@cache
def seeds() -> tuple[Seed, ...]:
    """The valid files every mutation starts from."""
    from protocol.tinygguf import write_tiny_gguf

    with tempfile.TemporaryDirectory() as folder:
        tiny = write_tiny_gguf(Path(folder) / "tiny.gguf").read_bytes()
    single = {
        "small": corpus.build(corpus.small_model()),
        "recurrent": corpus.build(corpus.recurrent_model()),
        "per_layer": corpus.build(corpus.per_layer_model()),
        "late_architecture": corpus.build(corpus.late_architecture_model()),
        "tiny": tiny,
    }
    out = [_seed(name, {"m.gguf": data}, "m.gguf") for name, data in single.items()]
    for count in (2, 3):
        out.append(_seed(f"split{count}", corpus.split_parts("big", count), SPLIT_FIRST[count]))
    return tuple(out)


SPLIT_FIRST = {count: f"big-00001-of-{count:05d}.gguf" for count in (2, 3)}
Example = tuple[dict[str, bytes], str]  # the files, the one read


@st.composite
def byte_mutations(draw: st.DrawFn) -> Example:
    """A seed with one file given one to four of: a byte, a 32- or 64-bit field set to
    an interesting value (counts, lengths, types, dimensions, offsets), a cut, an
    insertion, a deletion, a header range copied elsewhere (a duplicated entry)."""
    seed = draw(st.sampled_from(seeds()))
    target = draw(st.sampled_from(sorted(seed.files)))
    data = bytearray(seed.files[target])
    for _ in range(draw(st.integers(1, 4))):
        end = min(len(data), seed.header_ends[target])
        at = draw(st.integers(0, max(0, end - 1)))
        op = draw(st.sampled_from(("byte", "u32", "u64", "cut", "insert", "delete", "copy")))
        if op == "byte":
            if data:
                data[at] = draw(st.integers(0, 255))
        elif op in ("u32", "u64"):
            width = 4 if op == "u32" else 8
            value = draw(st.sampled_from(INTERESTING) | st.integers(0, 2 ** (8 * width) - 1))
            delta = draw(st.sampled_from((0, 0, 0, 1, -1)))
            raw = ((value + delta) % 2 ** (8 * width)).to_bytes(width, "little")
            data[at : at + width] = raw
        elif op == "cut":
            del data[draw(st.integers(0, len(data))) :]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=24))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        else:
            source = draw(st.integers(0, max(0, end - 1)))
            data[at:at] = data[source : source + draw(st.integers(1, 256))]
    return {**seed.files, target: bytes(data)}, seed.read


def _values(vtype: int) -> st.SearchStrategy[Any]:
    if vtype == corpus.STRING:
        return st.sampled_from(("llama", "mamba", "", "x" * 300)) | st.text(max_size=8)
    if vtype in (corpus.F32, corpus.F64):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if vtype == corpus.BOOL:
        return st.booleans()
    return st.sampled_from(INTERESTING + NEGATIVE) | st.integers(-(2**63), 2**64 - 1)


NEGATIVE = (-1, -2, -(2**31), -(2**63))
ODD = (13, 99, 2**31)  # value types the format does not have
_INTEGERS = (corpus.U8, corpus.I8, corpus.U16, corpus.I16, corpus.U32, corpus.I32)
_INTEGERS += (corpus.U64, corpus.I64)


@st.composite
def entries(draw: st.DrawFn) -> tuple[str | bytes, int, Any]:
    key: str | bytes = draw(st.sampled_from(KEYS) | st.text(max_size=6))
    vtype = draw(st.integers(0, 24))
    vtype = vtype if vtype <= 12 else vtype % 8 if vtype < 24 else draw(st.sampled_from(ODD))
    if vtype == corpus.ARRAY:
        item = draw(st.sampled_from((corpus.U32, corpus.I32, corpus.STRING, corpus.F32)))
        items = draw(st.lists(_values(item), max_size=6))
        return key, vtype, (item, items)
    return key, vtype, draw(_values(vtype))


@st.composite
def numbers(draw: st.DrawFn) -> tuple[str | bytes, int, Any]:
    """One of the keys the rules read, as an integer: zero, negative, huge, ordinary."""
    key = draw(st.sampled_from(KEYS[:19]))
    vtype = draw(st.sampled_from(_INTEGERS))
    small = st.sampled_from((0, 0, 1, 2, 4, 64, *NEGATIVE))
    return key, vtype, draw(small | st.sampled_from(INTERESTING) | st.integers(0, 64))


@st.composite
def tensors(draw: st.DrawFn) -> corpus.Tensor:
    dims = st.sampled_from(INTERESTING) | st.integers(1, 64)
    return corpus.Tensor(
        name=draw(st.sampled_from(NAMES) if draw(st.integers(0, 3)) else st.text(max_size=8)),
        shape=tuple(draw(st.lists(dims, min_size=1, max_size=5))),
        ttype=draw(st.integers(0, 40) | st.just(2**32 - 1)),
        offset=draw(st.none() | st.sampled_from(INTERESTING)),
    )


def _edit(draw: st.DrawFn, spec: corpus.Spec) -> corpus.Spec:
    """``spec`` with one to four entries or tensors replaced, added, dropped."""
    kvs, table = list(spec.kvs), list(spec.tensors)
    ops = ("number",) * 4 + ("set", "add", "drop", "tensor", "add_tensor", "drop_tensor")
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(ops))
        if op == "number":
            key, vtype, value = draw(numbers())
            found = [i for i, entry in enumerate(kvs) if entry[0] == key]
            if found:
                kvs[found[0]] = (key, vtype, value)
            else:
                kvs.append((key, vtype, value))
        elif op == "set" and kvs:
            at = draw(st.integers(0, len(kvs) - 1))
            _, vtype, value = draw(entries())
            kvs[at] = (kvs[at][0], vtype, value)
        elif op == "add":
            kvs.insert(draw(st.integers(0, len(kvs))), draw(entries()))
        elif op == "drop" and kvs:
            del kvs[draw(st.integers(0, len(kvs) - 1))]
        elif op == "tensor" and table:
            table[draw(st.integers(0, len(table) - 1))] = draw(tensors())
        elif op == "add_tensor":
            table.append(draw(tensors()))
        elif op == "drop_tensor" and table:
            del table[draw(st.integers(0, len(table) - 1))]
    miscount = draw(st.sampled_from((0,) * 10 + (1, -1)))
    n_kv = max(0, len(kvs) + miscount) if miscount else None
    return replace(spec, kvs=kvs, tensors=table, n_kv=n_kv)


@st.composite
def structures(draw: st.DrawFn) -> Example:
    """A small model, or one part of a split one, whose entries and tensors were edited."""
    models = (corpus.small_model, corpus.recurrent_model, corpus.late_architecture_model)
    model = draw(st.sampled_from((*models, None)))  # None: a split model
    if model is not None:
        return {"m.gguf": corpus.build(_edit(draw, model()))}, "m.gguf"
    count = draw(st.sampled_from((2, 3)))
    part = f"part{draw(st.integers(1, count))}"
    files = corpus.split_parts("big", count, **{part: lambda spec: _edit(draw, spec)})
    return files, SPLIT_FIRST[count]


def inputs() -> st.SearchStrategy[Example]:
    return byte_mutations() | structures()


@contextmanager
def traced() -> Iterator[None]:
    """tracemalloc on for the block, after one parse of every seed (first-call caches)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            for seed in seeds():
                check((seed.files, seed.read), Path(folder), Figures())
        yield
    finally:
        if started:
            tracemalloc.stop()


def check(example: Example, folder: Path, figures: Figures) -> None:
    """Read the example's files; fail on any answer but a summary or GgufInvalid naming a
    file, on a parse over PARSE_LIMIT_S, on a peak over their size plus ALLOWANCE."""
    files, read = example
    for stale in folder.iterdir():
        stale.unlink()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    size = sum(map(len, files.values()))
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    try:
        read_summary(folder / read)
        ok = True
    except GgufInvalid as exc:
        # The file, then the key or field and what was wrong with it.
        named = [name for name in files if exc.message.startswith(f"{name}: ")]
        assert named and len(exc.message) > len(named[0]) + 20, exc.message
        ok = False
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] - before
    figures.add(size=size, seconds=seconds, peak=peak, ok=ok)
    assert seconds < PARSE_LIMIT_S, f"a parse took {seconds:.3f} s"
    assert peak <= size + ALLOWANCE, f"peak {peak} B for {size} B of files"


def run(*, examples: int, folder: Path, figures: Figures) -> None:
    """One hypothesis run of ``examples`` examples (raises on the first failure)."""

    @settings(
        max_examples=examples,
        deadline=None,  # check() asserts PARSE_LIMIT_S on the parse alone
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(inputs())
    def one(example: Example) -> None:
        check(example, folder, figures)

    one()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to run")
    parser.add_argument("--batch", type=int, default=2000, help="examples per hypothesis run")
    args = parser.parse_args(argv)
    figures = Figures()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder, traced():
        while time.monotonic() - started < args.seconds:
            run(examples=args.batch, folder=Path(folder), figures=figures)
    print(json.dumps({"seconds": round(time.monotonic() - started, 1), **asdict(figures)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
