"""Secrets stay secret, proven on one real run (issue 17, part 8).

``./mirbad up`` (its own Redis and database), a second real agent enrolled with a
join token, a model downloaded onto it from a fake Hugging Face hub that needs a
token, started on the real llama-server (its engine key), an API key created and used
on /v1, then revoked and tried again. Every secret of the run (the API keys, the
console password, the join token, the Hugging Face token, the engine key) is then
searched for, whole and without its prefix, in:

- every file under the master's and both agents' folders (logs, engine logs, state,
  the database), but the two that exist to hold one (below); every key of Redis;
- what each process printed (``mirbad up``, ``agent join``, the agents' output);
- the argv of every process of the run (/proc/PID/cmdline), taken several times;
- every answer of the run: each /api and /v1 call made, and a GET of every /api path
  the schema lists, for each node, model and folder.

The only places a secret may be are its one-time reveal (the answer that created it,
exactly once; ``mirbad up`` prints its own key and password) and the two 0600 files
made to keep one: ``DATA/local-api-key`` (up's key) and the agent's ``processes.json``
(the engine key, which the agent needs to adopt its engine after a restart).
"""

from __future__ import annotations

import json
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from core.config import embedded_redis_socket
from protocol.tinygguf import write_tiny_gguf
from tests.e2e import conftest
from tests.e2e.conftest import join_agent, llama_server_or_fail, wait_for
from tests.fakehub import FakeHub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = "mirbad/private-GGUF"
FILE = "tiny-Q8_0.gguf"
EDGE = "edge-s"


@dataclass
class Record:
    """Everything a search reads: (where, text) pairs, and the one-time reveals."""

    answers: list[tuple[str, str]] = field(default_factory=list)
    argv: dict[int, tuple[str, str]] = field(default_factory=dict)
    printed: list[tuple[str, str]] = field(default_factory=list)

    def hook(self, response: httpx.Response) -> None:
        response.read()
        request = response.request
        where = f"{request.method} {request.url.raw_path.decode()} -> {response.status_code}"
        self.answers.append((where, response.text))

    def client(self, stack: Any, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=stack.url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
            event_hooks={"response": [self.hook]},
        )

    def snapshot_argv(self, roots: list[int]) -> None:
        """The argv of ``roots`` and all their descendants, as they are now."""
        for pid in roots:
            try:
                top = psutil.Process(pid)
                procs = [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in procs:
                try:
                    self.argv[proc.pid] = (proc.name(), "\0".join(proc.cmdline()))
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    pass


def _reveal(record: Record, where_prefix: str, field_name: str) -> tuple[str, str]:
    """The secret a creating answer revealed, and that answer's place in the record."""
    (where, text), *others = [(w, t) for w, t in record.answers if w.startswith(where_prefix)]
    assert not others, f"more than one {where_prefix}"
    return where, json.loads(text)[field_name]


def _forms(value: str) -> list[str]:
    """The whole secret and its part after a known prefix (mbd-, hf_), at least 16 chars."""
    forms = [value]
    for prefix in ("mbd-", "hf_"):
        if value.startswith(prefix):
            forms.append(value.removeprefix(prefix))
    return [f for f in forms if len(f) >= 16]


def _files(*roots: Path) -> Iterator[Path]:
    """Every regular file under ``roots``, but llama-server's build (laid out before any
    secret existed: 20 MB of libraries the run never writes)."""
    for root in roots:
        for path in sorted(root.rglob("*")):
            if "runtimes" in path.relative_to(root).parts:
                continue
            try:
                if stat.S_ISREG(path.lstat().st_mode):
                    yield path
            except FileNotFoundError:
                pass


def _redis_contents(socket: Path) -> list[tuple[str, bytes]]:
    """Every key of the stack's own Redis with its whole value (queues, caches, channels)."""
    import redis

    client = redis.Redis(unix_socket_path=str(socket))
    out: list[tuple[str, bytes]] = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        value: Any
        if kind == "string":
            value = client.get(key)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "set":
            value = client.smembers(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1)
        elif kind == "stream":
            value = client.xrange(key)
        else:
            value = b""
        out.append((f"redis {kind} {key.decode(errors='replace')}", key + repr(value).encode()))
    client.close()
    return out


def _get_every_api_path(api: httpx.Client, model_id: int) -> int:
    """GET each path of /api/schema for each node, model and folder; returns how many."""
    schema = api.get("/api/schema", params={"format": "json"}).json()
    values = {
        "node_id": ["local", EDGE],
        "model_id": [str(model_id)],
        "folder": ["tiny"],
        "key_id": [],  # /api/keys/{id} has no GET
        "token": [],  # a backup's download token: no backup in this run
    }
    query = {"node": EDGE, "file": FILE, "repo": REPO}
    count = 0
    for path, operations in schema["paths"].items():
        if "get" not in operations or not path.startswith("/api/"):
            continue
        names = [p["name"] for p in operations["get"].get("parameters", [])]
        params = {n: query[n] for n in names if n in query}
        urls = [path]
        for name, options in values.items():
            if "{" + name + "}" in path:
                urls = [u.replace("{" + name + "}", v) for u in urls for v in options]
        for url in urls:
            api.get(url, params=params)
            count += 1
    return count


def test_no_secret_in_logs_argv_or_answers(
    make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama_server_or_fail()
    started = time.monotonic()
    record = Record()
    hf_token = "hf_" + secrets.token_urlsafe(24)
    hub = FakeHub().start()
    try:
        hub.add_repo(REPO, {FILE: write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()},
                     token=hf_token)  # fmt: skip
        # The joined agent's environment is this process's (conftest.outside_env).
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        stack = make_stack(embedded=True)
        stack.env["HF_ENDPOINT"] = hub.url
        try:
            run(stack, record, hf_token, tmp_path, monkeypatch, started)
        except BaseException:
            stack.print_logs()
            raise
    finally:
        hub.stop()


def run(
    stack: Any,
    record: Record,
    hf_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    started: float,
) -> None:
    facts = stack.start()
    up_key, password = facts["API key"], facts["Admin"].removeprefix("admin ")
    api = record.client(stack, up_key)

    # -- a second agent, enrolled with a join token ----------------------------------
    def run_join(env: dict[str, str], join: dict[str, Any], state: Path, address: str) -> Any:
        done = real_run_join(env, join, state, address)
        record.printed.append(("the output of 'agent join'", done.stdout + done.stderr))
        return done

    real_run_join = conftest.run_join
    monkeypatch.setattr(conftest, "run_join", run_join)
    edge_dir = tmp_path / "edge"
    agent, _models = join_agent(api, stack, edge_dir, EDGE, "127.0.0.2")
    try:
        roots = [stack.process.pid, agent.pid]
        assert api.post(f"/api/nodes/{EDGE}/approve").status_code == 200
        wait_for(lambda: api.get(f"/api/nodes/{EDGE}").json()["state"] == "Online", 60, "Online")
        record.snapshot_argv(roots)

        # -- a download that needs the Hugging Face token --------------------------------
        inspect = "/api/downloads/inspect"
        refused = api.get(inspect, params={"repo": REPO})
        assert refused.json()["error"]["details"] == {"needsToken": True}, refused.text
        variants = api.get(inspect, params={"repo": REPO}, headers={"X-HF-Token": hf_token})
        assert [v["name"] for v in variants.json()["variants"]] == [FILE], variants.text
        body = {"folder": "tiny", "repoId": REPO, "variant": FILE, "token": hf_token}
        assert api.post("/api/downloads", params={"node": EDGE}, json=body).status_code == 202
        record.snapshot_argv(roots)
        done = wait_for(
            lambda: (
                (d := api.get("/api/downloads/tiny", params={"node": EDGE}).json()).get("state")
                in ("Completed", "Failed")
                and d
            ),
            60,
            "the download",
        )
        assert done["state"] == "Completed", done

        # -- the model on the real llama-server (the engine key) -------------------------
        model = {"servedName": "tiny", "sourceFolder": "tiny", "sourceFile": FILE,
                 "settings": {"context_size": 256, "gpu_layers": 0}, "node": EDGE}  # fmt: skip
        created = api.post("/api/models", json=model)
        assert created.status_code == 201, created.text
        model_id = created.json()["id"]
        assert api.post(f"/api/models/{model_id}/start").status_code == 202
        wait_for(lambda: api.get(f"/api/models/{model_id}").json()["state"] == "Ready", 90, "Ready")
        record.snapshot_argv(roots)
        assert any("llama-server" in name for name, _ in record.argv.values()), record.argv

        # -- an API key, used on /v1, revoked, tried again --------------------------------
        new = api.post("/api/keys", json={"name": "leak-check", "scopes": ["chat"]})
        assert new.status_code == 201, new.text
        user = record.client(stack, new.json()["key"])
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}  # fmt: skip
        assert user.post("/v1/chat/completions", json=chat).status_code == 200
        assert user.get("/v1/models").status_code == 200
        assert api.delete(f"/api/keys/{new.json()['id']}").status_code == 204
        assert user.post("/v1/chat/completions", json=chat).status_code == 401

        # -- every /api answer --------------------------------------------------------------
        gets = _get_every_api_path(api, model_id)
        for path in ("/api/audit", "/api/audit.csv", "/api/usage.csv"):
            api.get(path)
        record.snapshot_argv(roots)

        # The engine key, from the file the agent keeps it in (0600).
        processes = edge_dir / EDGE / "state" / "processes.json"
        assert stat.S_IMODE(processes.stat().st_mode) == 0o600
        (engine_key,) = [r["apiKey"] for r in json.loads(processes.read_text())["instances"]]
        assert api.post(f"/api/models/{model_id}/stop").status_code == 200
        in_redis = _redis_contents(embedded_redis_socket(stack.data))
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    assert stack.stop() == 0  # every log flushed and closed
    record.printed.append(("the output of 'mirbad up'", "\n".join(stack.lines)))

    key_reveal, new_key = _reveal(record, "POST /api/keys -> 201", "key")
    join_reveal, join_token = _reveal(record, "POST /api/join-tokens -> 201", "token")
    local_key_file = stack.data / "local-api-key"
    assert stat.S_IMODE(local_key_file.stat().st_mode) == 0o600
    assert local_key_file.read_text().strip() == up_key
    secrets_of_run = {
        "the API key mirbad up made": up_key,
        "the console admin password": password,
        "the API key created": new_key,
        "the join token": join_token,
        "the Hugging Face token": hf_token,
        "the engine key": engine_key,
    }
    # Where each may be: its reveal, and the one file that exists to keep it.
    allowed = {
        "the API key mirbad up made": {f"file {local_key_file}", f"line API key: {up_key}"},
        "the console admin password": {f"line Admin: admin {password}"},
        "the API key created": {key_reveal},
        "the join token": {join_reveal},
        "the engine key": {f"file {processes}"},
    }

    places: list[tuple[str, bytes]] = []
    for path in _files(stack.data, edge_dir):
        places.append((f"file {path}", path.read_bytes()))
    for what, text in record.printed:
        for line in text.splitlines():
            places.append((f"line {line}" if what.endswith("'mirbad up'") else what, line.encode()))
    for pid, (name, argv) in record.argv.items():
        places.append((f"argv of {name} ({pid}): {argv.replace(chr(0), ' ')[:200]}", argv.encode()))
    for where, text in record.answers:
        places.append((where, text.encode()))
    places += in_redis

    found: list[str] = []
    revealed: dict[str, int] = {}
    for name, value in secrets_of_run.items():
        for form in _forms(value):
            for where, data in places:
                if form.encode() not in data:
                    continue
                if where in allowed.get(name, set()):
                    revealed[name] = revealed.get(name, 0) + (form == value)
                    continue
                found.append(f"{name} ({'whole' if form == value else 'without its prefix'}) "
                             f"in {where}")  # fmt: skip
    files = sum(w.startswith("file ") for w, _ in places)
    print(
        f"\nsearched {len(secrets_of_run)} secrets in {files} files, {len(record.argv)} "
        f"processes' argv, {len(record.answers)} answers ({gets} schema GETs), "
        f"{len(in_redis)} Redis keys and the output of {len(record.printed)} commands, "
        f"in {time.monotonic() - started:.0f} s"
    )
    assert found == [], "secrets found:\n" + "\n".join(found)
    # Each reveal happened exactly once, where it should (a test that saw none proves nothing).
    assert revealed == {
        "the API key mirbad up made": 2,  # the 0600 file and up's printed line
        "the console admin password": 1,
        "the API key created": 1,
        "the join token": 1,
        "the engine key": 1,
    }, revealed
    assert files > 20 and len(record.argv) >= 8 and gets > 20 and in_redis
