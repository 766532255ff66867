"""A real web process (uvicorn, as ``./mirbad up`` runs it): throttles and bad input on the wire.

One process on a fresh data directory (SQLite) and the test Redis. It checks what
only a real server shows: the source address comes from the socket, the login runs
under ASGI, and a NUL or a ``?file=`` survives uvicorn's path decoding as far as the
view, which refuses it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "e2e-right-password-1"
SETUP = """
import django
django.setup()
from django.contrib.auth import get_user_model
from router import keys
get_user_model().objects.create_user("ops", password=%r, is_staff=True)
print(keys.create_key(name="e2e", scopes=["admin", "chat"])[1])
"""


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(base URL, an admin+chat key, the web log) of a running web process."""
    data = tmp_path_factory.mktemp("web")
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "MIRBAD_DATABASE_URL"},
        "MIRBAD_DATA_PATH": str(data),
        "MIRBAD_PORT": str(port),
        "DJANGO_SETTINGS_MODULE": "mirbad_site.settings",
    }
    py = sys.executable
    subprocess.run([py, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    key = subprocess.run(
        [py, "-c", SETUP % PASSWORD], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    log_path = data / "web.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [py, "-m", "uvicorn", "mirbad_site.asgi:application", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/login/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the web process did not start:\n{log_path.read_text()}")
            time.sleep(0.3)
        yield base, key, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _login(client: httpx.Client, password: str) -> httpx.Response:
    page = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None
    return client.post(
        "/login/",
        data={"username": "ops", "password": password, "csrfmiddlewaretoken": token.group(1)},
    )


def test_console_login_throttle_on_a_real_socket(web: tuple[str, str, Path]) -> None:
    base, _, log_path = web
    with httpx.Client(base_url=base, timeout=30) as client:
        assert _login(client, PASSWORD).status_code == 302  # a success counts nothing
    with httpx.Client(base_url=base, timeout=30) as client:
        for i in range(10):
            assert _login(client, f"wrong-{i}").status_code == 200
        refused = _login(client, PASSWORD)
    assert refused.status_code == 429 and 890 <= int(refused.headers["retry-after"]) <= 900
    log = log_path.read_text()
    assert log.count("Failed login for account 'ops' from 127.0.0.1 on /login/") == 10
    assert "wrong-" not in log


def test_v1_key_throttle_and_bad_bodies_on_a_real_socket(web: tuple[str, str, Path]) -> None:
    base, key, _ = web
    with httpx.Client(base_url=base, timeout=30) as client:
        ok = {"Authorization": f"Bearer {key}"}
        surrogate = client.post(
            "/v1/chat/completions", content=b'{"model": "\\ud800", "messages": []}', headers=ok
        )
        assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "model"
        nested = client.post("/v1/chat/completions", content=b"[" * 100_000, headers=ok)
        assert nested.status_code == 400
        for folder in ("a%00b", "a%3Ffile%3Dx.gguf"):
            response = client.get(f"/api/model-folders/{folder}/gguf", headers=ok)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["details"] == {"field": "folder"}
        for i in range(10):
            bad = client.post(
                "/v1/chat/completions",
                json={"model": "m"},
                headers={"Authorization": f"Bearer mbd-e2e-guess-{i}"},
            )
            assert bad.status_code == 401
        refused = client.post("/v1/chat/completions", json={"model": "m"}, headers=ok)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_failed_keys"
        assert int(refused.headers["retry-after"]) >= 890
