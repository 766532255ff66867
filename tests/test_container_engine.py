"""A real OpenAI-compatible engine in a real container on this machine (issue 16's
ground): Podman's Docker API driven by the `docker` SDK runs the engine image built
from the test llama-server, with a port published on 127.0.0.1, the model folder
mounted read-only and the API key in the environment; it answers /health and a
chat completion; the mount is read-only as the runtime reports it."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import httpx
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.containers import engine_image, podman_socket
from tests.e2e.conftest import llama_server_or_fail
from tests.parallel import free_port

# Podman's store and container names are one per machine (tests/containers.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("podman_serial")]


def test_the_engine_image_serves_from_a_read_only_mount(tmp_path: Path) -> None:
    import docker

    server = llama_server_or_fail()
    models = tmp_path / "models" / "tiny"
    write_tiny_gguf(models / "tiny.gguf")
    with podman_socket(tmp_path / "podman") as (sock, env):
        image = engine_image(server, env, tmp_path / "image")
        client = docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
        key = secrets.token_hex(16)
        port = free_port()
        container = client.containers.run(
            image,
            command=["--model", "/models/tiny/tiny.gguf", "--host", "0.0.0.0", "--port", "8080",
                     "--ctx-size", "256", "--parallel", "1"],
            environment={"LLAMA_API_KEY": key},
            ports={"8080/tcp": ("127.0.0.1", port)},
            volumes={str(models.parent): {"bind": "/models", "mode": "ro"}},
            labels={"mirbad.test": "engine"},
            detach=True,
        )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                container.reload()
                assert container.status == "running", container.logs()[-2000:]
                assert time.monotonic() < deadline, container.logs()[-2000:]
                time.sleep(0.3)
            answer = httpx.post(
                f"{base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["role"] == "assistant"
            refused = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, timeout=10)
            assert refused.status_code == 401  # the key came through the environment
            mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
            assert mounts["/models"]["RW"] is False
            assert client.containers.list(filters={"label": "mirbad.test=engine"})
        finally:
            container.remove(force=True)
            client.close()
