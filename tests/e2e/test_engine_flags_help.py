"""The flag allow-list against the installed llama-server's own --help (drift check).

Every allowed spelling must be a flag of the real engine, take a value exactly when
its shape does, and the built-in template list must be the engine's own. The engine's
version must be covered by a table of its own, not by the newest-table fallback, so
bumping the pinned runtime fails here until the allow-list is reviewed.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from agent.engines._install import probe_version
from protocol.engine_flags import ENGINE_FLAG_TABLES, engine_flags
from tests.e2e.conftest import llama_server_or_fail

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

_FLAG_RE = re.compile(r"-{1,2}[A-Za-z0-9][A-Za-z0-9_.+-]*")


def read_help(binary: Path) -> str:
    done = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def parse_help(text: str) -> tuple[dict[str, bool], list[str]]:
    """Each flag spelling -> whether it takes a value; and the built-in template names.

    A flag line reads ``-t,    --threads N      description`` (spellings joined by
    commas, the value hint after the last one, the description after a gap).
    """
    flags: dict[str, bool] = {}
    lines = text.splitlines()
    for line in lines:
        if not line.startswith("-"):
            continue
        head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line), maxsplit=1)[0]
        spellings = head.split(", ")
        last = spellings[-1].split(" ", 1)
        spellings[-1] = last[0]
        if all(_FLAG_RE.fullmatch(name) for name in spellings):
            flags.update(dict.fromkeys(spellings, len(last) == 2))
    # The list follows "list of built-in templates:" on indented lines, comma-separated.
    start = next(i for i, line in enumerate(lines) if "list of built-in templates:" in line)
    templates: list[str] = []
    for line in lines[start + 1 :]:
        if not line.startswith(" ") or not re.fullmatch(r"\s+[\w.,\s-]+", line):
            break
        templates += [t.strip() for t in line.split(",") if t.strip()]
    return flags, templates


def test_allow_list_matches_the_installed_llama_server() -> None:
    binary = llama_server_or_fail()
    version = probe_version(binary)
    table = engine_flags("llamacpp", version)
    match = re.match(r"(\d+)\.(\d+)", version)
    assert match and table.covers((int(match[1]), int(match[2]))), (
        f"llama-server {version} has no allow-list table of its own "
        f"(tables: {[t.label for t in ENGINE_FLAG_TABLES]}); review its flags and add one"
    )
    help_flags, templates = parse_help(read_help(binary))
    missing = [n for f in table.flags for n in f.names if n not in help_flags]
    assert missing == [], f"allowed but not flags of llama-server {version}: {missing}"
    wrong = [n for f in table.flags for n in f.names if help_flags[n] != f.shape.takes_value]
    assert wrong == [], f"value or no value differs from llama-server {version}: {wrong}"
    assert sorted(templates) == sorted(table.chat_templates)


def test_builtin_template_renders_as_that_template(tmp_path: Path) -> None:
    """The builder's argv for ``builtin:llama3`` makes the real engine use llama3's format.

    With Jinja on (the engine's default) ``--chat-template llama3`` is read as template
    source and every prompt renders as the word "llama3"; the builder turns Jinja off.
    """
    from models_registry.llamacpp import LlamaCppSettings, build_argv
    from protocol.tinygguf import write_tiny_gguf
    from tests.e2e.conftest import free_port

    binary = llama_server_or_fail()
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    port = free_port()
    argv = build_argv(
        settings=LlamaCppSettings.from_dict({"chat_template": "builtin:llama3"}),
        served_name="tiny",
    )
    argv = [str(model) if a == "{model}" else str(port) if a == "{port}" else a for a in argv]
    log = (tmp_path / "engine.log").open("wb")
    engine = subprocess.Popen([str(binary), *argv], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become healthy in 60 s"
            time.sleep(0.3)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/apply-template",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        prompt = answer.json()["prompt"]
        assert prompt != "llama3"
        assert "<|start_header_id|>user<|end_header_id|>" in prompt and "Hi" in prompt
    finally:
        engine.terminate()
        engine.wait(timeout=10)
        log.close()
