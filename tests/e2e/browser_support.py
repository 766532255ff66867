"""What the Chromium tests share: Debian's chromium, a stack with the tiny model and a
fake hub, and the console's login."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import llama_server_or_fail
from tests.fakehub import FakeHub

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def stack_with_hub(
    make_stack: Any, request: pytest.FixtureRequest, env: dict[str, str] | None = None
) -> tuple[Any, FakeHub, dict[str, str]]:
    """A started stack (its own Redis and database) with llama-server, the tiny model in
    models/tiny and HF_ENDPOINT on a fake hub; fails (never skips) without chromium."""
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is not installed: 'apt-get install chromium'")
    llama_server_or_fail()
    stack = make_stack(embedded=False)
    stack.prepare_local_model()
    hub = FakeHub().start()
    request.addfinalizer(hub.stop)
    stack.env["HF_ENDPOINT"] = hub.url
    stack.env.update(env or {})
    return stack, hub, stack.start()


def launch(pw: Any) -> Any:
    return pw.chromium.launch(
        executable_path=str(CHROMIUM), args=ARGS, headless=True, env={**os.environ}
    )


def log_in(page: Any, stack: Any, facts: dict[str, str]) -> None:
    """The Overview first sends the browser to the login page; log in as the admin."""
    user, password = facts["Admin"].split(" ", 1)
    page.goto(f"{stack.url}/")
    assert "/login/" in page.url  # the console needs a login
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", password)
    page.click("#login")
    page.wait_for_url(f"{stack.url}/")
