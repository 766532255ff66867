"""Hostile GGUF files (issue 17): each known bug class refused before any large allocation,
headers that cannot be a model refused with the key named (also over HTTP), a fuzz smoke.

The files are tests/agent/gguf_corpus.py's; the figures asserted on each (only
GgufInvalid, a parse under PARSE_LIMIT_S, a tracemalloc peak at most the file's size
plus ALLOWANCE) are tests/agent/fuzz_gguf.py's, which runs the same check for longer.
"""

from __future__ import annotations

import itertools
import re
import string
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from agent_support import RunningAgent

from agent.weights._gguf import GgufInvalid, read_summary
from tests.agent import gguf_corpus as corpus
from tests.agent.fuzz_gguf import ALLOWANCE, PARSE_LIMIT_S, Figures, run, traced

# About 8 s on a CI core; `python -m tests.agent.fuzz_gguf --seconds 600` runs longer.
SMOKE_EXAMPLES = 400


@pytest.fixture(scope="module")
def tracing() -> Iterator[None]:
    with traced():
        yield


def _write(folder: Path, case: corpus.Case) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in case.files.items():
        (folder / name).write_bytes(data)
    return folder / case.read


def _measure(folder: Path, case: corpus.Case) -> tuple[str | None, float, int]:
    """(the refusal, or None; seconds; peak traced bytes) of reading the case."""
    path = _write(folder, case)
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    try:
        read_summary(path)
        message = None
    except GgufInvalid as exc:
        message = exc.message
    seconds = time.perf_counter() - started
    return message, seconds, tracemalloc.get_traced_memory()[1] - before


def _refused(folder: Path, case: corpus.Case) -> str:
    message, seconds, peak = _measure(folder, case)
    assert message is not None, "the file was accepted"
    assert re.search(case.match, message), message
    assert message.startswith(f"{case.read}: ") or message.startswith("big-0000"), message
    assert seconds < PARSE_LIMIT_S, f"refused after {seconds:.3f} s"
    # Before any large allocation: what the parse held at its peak is the fixed cost
    # of a parse, whatever size the file claims for its arrays, strings and tensors.
    assert peak <= case.size + ALLOWANCE, f"peak {peak} B for {case.size} B of files"
    return message


@pytest.mark.parametrize("name", sorted(corpus.REGRESSIONS))
def test_known_bug_class_is_refused(name: str, tmp_path: Path, tracing: None) -> None:
    _refused(tmp_path, corpus.REGRESSIONS[name])


@pytest.mark.parametrize("name", sorted(corpus.SEMANTIC))
def test_header_that_cannot_be_a_model_is_refused(name: str, tmp_path: Path, tracing: None) -> None:
    _refused(tmp_path, corpus.SEMANTIC[name])


def test_real_model_shapes_are_accepted(tmp_path: Path, tracing: None) -> None:
    """The rules do not refuse what converters really write."""
    found = {}
    for name, case in corpus.accepted().items():
        message, seconds, peak = _measure(tmp_path / name, case)
        assert message is None, f"{name}: {message}"
        assert seconds < PARSE_LIMIT_S and peak <= case.size + ALLOWANCE, (name, seconds, peak)
        found[name] = read_summary(tmp_path / name / case.read)
    recurrent = found["recurrent_head_count_zero"]
    assert recurrent["architecture"] == "mamba" and recurrent["headCount"] == 0
    assert recurrent["ssmStateSize"] == 16
    assert found["per_layer_head_count_kv"]["headCountKv"] == 2  # the largest layer's
    late = found["architecture_written_last"]
    assert late["blockCount"] == 2 and late["contextLength"] == 64 and late["vocabSize"] == 16
    split = found["split_in_three"]
    assert split["parts"] == [f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split["tensorBytesAllParts"] > split["tensorBytes"] > 0


def _keys(count: int) -> Iterator[bytes]:
    alphabet = (string.ascii_letters + string.digits).encode()
    for combo in itertools.islice(itertools.product(alphabet, repeat=3), count):
        yield bytes(combo)


def test_memory_stays_below_the_file_for_many_entries(tmp_path: Path, tracing: None) -> None:
    """Per entry the reader keeps 8 bytes (a key's hash) or 24 (a tensor's hash, offset,
    size); the file spends at least 14 and 33: the peak stays under the file's size."""
    base = corpus.small_model()
    keys = [corpus.kv(key, corpus.U8, 1) for key in _keys(20_000)]
    table = [corpus.Tensor(b"t" + key, (1,)) for key in _keys(5_000)]
    spec = replace(base, extra=keys, tensors=base.tensors + table)
    case = corpus.Case(files={"m.gguf": corpus.build(spec)}, read="m.gguf", match="")
    message, _, peak = _measure(tmp_path, case)
    assert message is None, message
    assert peak < case.size, f"peak {peak} B for a file of {case.size} B"


def test_fuzz_smoke(tmp_path: Path, tracing: None) -> None:
    figures = Figures()
    run(examples=SMOKE_EXAMPLES, folder=tmp_path, figures=figures)
    print(f"fuzz smoke: {figures}")
    assert figures.examples >= SMOKE_EXAMPLES
    assert figures.accepted and figures.refused  # both answers were reached
    assert figures.max_parse_s < PARSE_LIMIT_S
    assert figures.max_peak_over_size <= ALLOWANCE


async def test_semantic_refusals_over_http(running_agent: RunningAgent) -> None:
    """The agent's endpoint answers each 422 gguf_invalid naming the key."""
    root = running_agent.server.config.models_root_path
    for name, case in corpus.SEMANTIC.items():
        folder = name.replace("_", "-")
        _write(root / folder, case)
        url = running_agent.url(f"/agent/v1/folders/{folder}/gguf?file={case.read}")
        async with running_agent.session.get(url) as resp:
            body = await resp.json()
        assert resp.status == 422, (name, body)
        assert body["error"]["code"] == "gguf_invalid", (name, body)
        assert re.search(case.match, body["error"]["message"]), (name, body)
