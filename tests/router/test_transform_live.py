"""router.transform against a real llama-server: the captured fixtures still hold.

Slow; needs MIRBAD_TEST_LLAMA_SERVER (as tests/agent do) and skips without it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from protocol.tinygguf import write_tiny_gguf
from router.sse import StreamFilter, UsageSniffer
from router.transform import prepare, transform_embeddings
from tests.parallel import free_port
from tests.router.test_transform import _normalise

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exe() -> Path:
    value = os.environ.get("MIRBAD_TEST_LLAMA_SERVER")
    if not value:
        pytest.skip("MIRBAD_TEST_LLAMA_SERVER is not set")
    return Path(value)


def _serve(exe: Path, model: Path, log: Path, *extra: str) -> Iterator[str]:
    port = free_port()
    argv = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", "256", "-np", "1", "--no-webui", *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"llama-server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()  # only the process this test started
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def chat_server(exe: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(exe, model, tmp_path_factory.mktemp("log") / "chat.log")


@pytest.fixture(scope="module")
def embedding_server(
    exe: Path, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    log = tmp_path_factory.mktemp("log") / "embed.log"
    yield from _serve(exe, model, log, "--embedding", "--pooling", "mean")


def _post_stream(url: str, body: bytes, sink: StreamFilter | None = None) -> bytes:
    out = []
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", url, content=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            out.append(sink.feed(chunk) if sink else chunk)
    if sink:
        out.append(sink.close())
    return b"".join(out)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_injected_stream_matches_the_plain_one(chat_server: str, path: str) -> None:
    fields: dict[str, object] = {"model": "tiny", "max_tokens": 8, "seed": 7, "temperature": 0}
    if path == "/v1/chat/completions":
        fields["messages"] = [{"role": "user", "content": "hello world"}]
    else:
        fields["prompt"] = "hello world"
    body = json.dumps({**fields, "stream": True}).encode()
    plain = _post_stream(chat_server + path, body)
    prepared = prepare(path, body, emulate_dimensions=False)
    assert prepared.injected_usage
    sink = StreamFilter(injected_usage=True)
    filtered = _post_stream(chat_server + path, prepared.body, sink)
    assert _normalise(filtered) == _normalise(plain)
    assert sink.usage is not None and sink.usage[1] == 8


def test_non_stream_usage_is_sniffed(chat_server: str) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(chat_server + "/v1/chat/completions", json=body, timeout=60)
    sniffer = UsageSniffer()
    for i in range(0, len(response.content), 50):
        sniffer.feed(response.content[i : i + 50])
    usage = response.json()["usage"]
    assert sniffer.usage == (usage["prompt_tokens"], usage["completion_tokens"])


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_dimensions_emulated(embedding_server: str, fmt: str) -> None:
    url = embedding_server + "/v1/embeddings"
    fields = {"model": "tiny", "input": ["hello world", "the model"], "encoding_format": fmt}
    full = httpx.post(url, json=fields, timeout=60)
    body = json.dumps({**fields, "dimensions": 10}).encode()
    prepared = prepare("/v1/embeddings", body, emulate_dimensions=True)
    assert b"dimensions" not in prepared.body
    upstream = httpx.post(url, content=prepared.body, timeout=60)
    out = json.loads(transform_embeddings(prepared, upstream.content))

    def vectors(doc: dict) -> list[np.ndarray]:
        items = sorted(doc["data"], key=lambda item: item["index"])
        if fmt == "base64":
            return [np.frombuffer(base64.b64decode(i["embedding"]), "<f4") for i in items]
        return [np.asarray(i["embedding"]) for i in items]

    for got, native in zip(vectors(out), vectors(full.json()), strict=True):
        assert got.shape == (10,) and native.shape == (64,)
        expected = native[:10] / np.linalg.norm(native[:10].astype(np.float64))
        np.testing.assert_allclose(got, expected, rtol=1e-5)
