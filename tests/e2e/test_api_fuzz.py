"""/api fuzzed by schemathesis against a live master: every operation, every check.

``./mirbad up`` starts a real master (uvicorn, the monitor, Celery, the local agent,
its own Redis) on a throwaway data directory. The test gives it something to work
on (a model folder with a tiny GGUF, two models, a second enrolled node that no
agent serves, a second key, a backup to download), then runs the schemathesis CLI
as CI would: the schema read from the live ``/api/schema``, an admin key, every
check but one (``--checks all``: not_a_server_error, the response, status code,
content type and header conformance, negative data, auth enforcement, use after
free, ...; :data:`CONFIG` says which and why), the coverage, fuzzing and stateful
phases. It asserts every operation of the schema was tested and nothing failed.

tests/e2e/api_fuzz_hooks.py keeps the run meaningful to its end (no lockout by the
failure throttle, destructive operations on throwaway targets); its docstring says
why. ``MIRBAD_API_FUZZ_EXAMPLES`` raises the cases per operation (default 10) and
``MIRBAD_API_FUZZ_SEED`` picks the seed (default 17, so CI is repeatable), e.g.
``MIRBAD_API_FUZZ_EXAMPLES=500 MIRBAD_API_FUZZ_SEED=$RANDOM pytest
tests/e2e/test_api_fuzz.py``; docs/security.md, "API fuzzing".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.tinygguf import write_tiny_gguf
from tests.e2e.conftest import ROOT, free_port, outside_env, run_join

EXAMPLES = int(os.environ.get("MIRBAD_API_FUZZ_EXAMPLES", "10"))
SEED = int(os.environ.get("MIRBAD_API_FUZZ_SEED", "17"))
# 10 cases per operation take about 20 s; 150 about 2 minutes (2 cores, 47 operations).
RUN_TIMEOUT = 120 + 12 * EXAMPLES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT + 120)]
METHODS = ("get", "put", "post", "patch", "delete", "head", "options", "trace")


def _operations(schema: dict[str, Any]) -> set[str]:
    return {
        f"{method.upper()} {path}"
        for path, item in schema["paths"].items()
        for method in item
        if method in METHODS
    }


def _created(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def _prepare(stack: Any, admin: httpx.Client, tmp_path: Path) -> dict[str, Any]:
    """What the hooks swap drawn path values for: real, and throwaway where destroyed."""
    fuzzer = _created(admin.post("/api/keys", json={"name": "fuzzer", "scopes": ["admin"]}))
    spare_key = _created(admin.post("/api/keys", json={"name": "spare", "scopes": ["chat"]}))
    # A second node, enrolled but served by no agent: what revoke may destroy.
    join = _created(admin.post("/api/join-tokens", json={"nodeId": "spare"}))
    joined = run_join(outside_env(), join, tmp_path / "spare", f"https://127.0.0.3:{free_port()}")
    assert joined.returncode == 0, joined.stdout + joined.stderr
    models = {}
    for name in ("fuzz-keep", "fuzz-doomed"):
        body = {"servedName": name, "sourceFolder": "tiny", "sourceFile": "tiny.gguf"}
        models[name] = _created(admin.post("/api/models", json={**body, "node": "local"}))["id"]
    backup = _created(admin.post("/api/backups", json={}))
    return {
        "key": fuzzer["key"],
        "plan": {
            "fuzzKey": fuzzer["id"],
            "spareKey": spare_key["id"],
            "node": "local",
            "spareNode": "spare",
            "model": models["fuzz-keep"],
            "doomedModel": models["fuzz-doomed"],
            "folder": "tiny",
            "backupToken": backup["downloadUrl"].rsplit("/", 1)[1],
        },
    }


# Every check, one left out and one widened, each with its reason:
# - positive_data_acceptance (a schema-valid request must succeed) is left out: the schema
#   names each field's JSON type, while the rules beyond the type (names, ranges, what
#   exists, what the node can run) are the services', shared with the console
#   (docs/decisions.md D41), so a schema-valid body is often rightly refused (400, 422).
#   negative_data_rejection, its mirror, runs: a body the schema refuses must be refused.
# - not_a_server_error accepts 501-504: the documented answers about a node (501
#   not_supported, 502 an agent's bad answer, 503 unreachable, 504 timed out;
#   docs/operator-guide.md), and status_code_conformance still fails any the operation
#   does not declare. A 500 always fails.
# No cache: it would write .schemathesis/ into the working tree (the run's cwd).
CONFIG = """
[cache]
enabled = false

[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "501", "502", "503", "504"]
"""


def _schemathesis(url: str, key: str, plan: dict[str, Any], reports: Path) -> dict[str, Any]:
    """Run the CLI; its JSON report."""
    config = reports / "schemathesis.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(CONFIG)
    env = {
        **outside_env(),
        "SCHEMATHESIS_HOOKS": "tests.e2e.api_fuzz_hooks",
        "MIRBAD_FUZZ_PLAN": json.dumps(plan),
    }
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
        "run", f"{url}/api/schema?format=json", "--header", f"Authorization: Bearer {key}",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", str(EXAMPLES), "--seed", str(SEED),
        "--workers", "2", "--request-timeout", "30", "--generation-database", "none",
        "--report", "json", "--report-dir", str(reports), "--no-color",
    ]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    print(result.stdout[-20000:], result.stderr[-4000:], sep="\n")
    print(f"schemathesis ran {time.monotonic() - started:.1f} s")
    found = list(reports.glob("*.json"))
    assert found, f"schemathesis wrote no report (exit {result.returncode})"
    report: dict[str, Any] = json.loads(found[0].read_text())
    return report


def test_every_api_operation_survives_schemathesis(make_stack: Any, tmp_path: Path) -> None:
    stack = make_stack(embedded=True)
    # The hub is a closed port: /api/downloads/inspect answers 502 at once, never the network.
    stack.env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    write_tiny_gguf(stack.data / "models" / "tiny" / "tiny.gguf")
    facts = stack.start()
    with stack.api(facts["API key"]) as admin:
        prepared = _prepare(stack, admin, tmp_path)
        schema = admin.get("/api/schema?format=json").json()
    operations = _operations(schema)

    try:
        report = _schemathesis(stack.url, prepared["key"], prepared["plan"], tmp_path / "st")
    except BaseException:
        stack.print_logs()
        raise

    tested = report["operations"]
    generated = report["test_cases"]["generated"]
    print(
        f"{len(operations)} operations in the schema, {tested['tested']} tested, "
        f"{generated} test cases, failures: "
        + (", ".join(f"{f['code']} {f['title']}: {f['count']}" for f in report["failures"]) or "0")
    )
    assert tested["total"] == tested["selected"] == tested["tested"] == len(operations), tested
    assert tested["errored"] == 0 and tested["skipped"] == 0, tested
    assert report["stop_reason"] == "completed", report["stop_reason"]
    assert report["errors"] == [], report["errors"]
    assert report["failures"] == [], report["failures"]
    # No lockout: no operation was answered mostly 429, and the fuzzer's key still works
    # on the node it was kept off revoking.
    assert report["warnings"]["rate_limited"] == [], report["warnings"]["rate_limited"]
    assert generated >= len(operations) * 2, generated
    with stack.api(prepared["key"]) as fuzzer:
        local = fuzzer.get("/api/nodes/local")
        assert local.status_code == 200 and not local.json()["revoked"], local.text
