"""The console an operator lives in, in headless Chromium against a real stack (issue 14):
a node that enrolls appears on an open Overview and is approved there, goes Offline live
when killed with its last error; a model made in the editor with a live estimate, started
from the Models page, its engine's log followed; a download's progress; a refreshed Keys
page; every page free of JavaScript errors and failed requests. Each step saves a
screenshot under the test's tmp_path (printed at the end)."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser_support import launch, log_in, stack_with_hub
from tests.e2e.conftest import join_agent, wait_for

pytestmark = pytest.mark.slow


class PageWatch:
    """Every JavaScript error, console error and failed or refused request of a page."""

    def __init__(self, page: Any, base: str) -> None:
        self.problems: list[str] = []
        self.base = base
        page.on("pageerror", lambda exc: self.problems.append(f"JS error: {exc}"))
        page.on("console", self._console)
        page.on("requestfailed", self._failed)
        page.on("response", self._response)

    def _console(self, message: Any) -> None:
        if message.type == "error":
            where = (message.location or {}).get("url", "")
            self.problems.append(f"console error: {message.text} ({where}, on {message.page.url})")

    def _failed(self, request: Any) -> None:
        # A fetch the browser aborts because the page navigates away is not a failure.
        if request.failure != "net::ERR_ABORTED":
            self.problems.append(f"failed: {request.method} {request.url}: {request.failure}")

    def _response(self, response: Any) -> None:
        if response.url.startswith(self.base) and response.status >= 400:
            self.problems.append(
                f"HTTP {response.status}: {response.request.method} {response.url}"
            )


def test_the_console_pages_in_chromium(
    make_stack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from playwright.sync_api import expect, sync_playwright

    stack, hub, facts = stack_with_hub(make_stack, request)
    api = stack.api(facts["API key"], timeout=30)
    shots = tmp_path / "screenshots"
    shots.mkdir()

    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        watch = PageWatch(page, stack.url)

        def shot(name: str) -> None:
            page.screenshot(path=str(shots / f"{name}.png"), full_page=True)

        log_in(page, stack, facts)
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        expect(page.locator('tr[data-node="local"] .state')).to_contain_text(
            "Online", timeout=20_000
        )
        shot("01-overview")

        # A second agent joins while the Overview is open: its row appears live, with
        # the full fingerprint beside Approve, and it is approved from there.
        page.evaluate("window.__noReload = 1")
        agent, _models = join_agent(api, stack, tmp_path / "edge", "edge-1", "127.0.0.2")
        try:
            row = page.locator('tr[data-node="edge-1"]')
            expect(row.locator(".state")).to_contain_text("PendingApproval", timeout=20_000)
            fingerprint = api.get("/api/nodes/edge-1").json()["fingerprint"]
            expect(row.locator(".fingerprint")).to_have_text(fingerprint)
            assert page.evaluate("window.__noReload") == 1, "the Overview was reloaded"
            expect(page.locator("#attention")).to_contain_text(
                "Waiting for approval", timeout=5_000
            )
            shot("02-enrolled-live")
            row.locator('button[data-action="approve"]').click()
            page.wait_for_url(f"{stack.url}/")
            expect(page.locator("#messages")).to_contain_text("edge-1: Approved.")
            row = page.locator('tr[data-node="edge-1"]')
            expect(row.locator(".state")).to_contain_text("Online", timeout=30_000)
            shot("03-approved")

            # Killed: Offline live, with the last error on the row and in Needs attention.
            page.evaluate("window.__noReload = 2")
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=10)
            expect(row.locator(".state")).to_contain_text("Offline", timeout=30_000)
            expect(row.locator(".last-error")).not_to_be_empty(timeout=10_000)
            expect(page.locator("#attention")).to_contain_text("edge-1", timeout=10_000)
            assert page.evaluate("window.__noReload") == 2, "the Overview was reloaded"
            shot("04-offline-live")
        finally:
            if agent.poll() is None:
                agent.kill()

        # The Nodes list and the node page with its charts.
        page.goto(f"{stack.url}/nodes/")
        expect(page.locator('tr[data-node="edge-1"]')).to_have_class(re.compile("stale"))
        # Its filters are GET parameters: the form makes a URL that can be shared, and
        # the live socket then follows only the rows shown.
        page.select_option("#node-state", "Offline")
        page.click("#node-search button[type=submit]")
        page.wait_for_url(re.compile(r"/nodes/\?.*state=Offline"))
        expect(page.locator('tr[data-node="edge-1"]')).to_have_count(1)
        expect(page.locator('tr[data-node="local"]')).to_have_count(0)
        expect(page.locator("#node-count")).to_contain_text("1 matching · 2 nodes")
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        shot("04b-nodes-filtered")
        page.goto(f"{stack.url}/nodes/local/")
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        expect(page.locator("#charts figure.chart").first).to_be_visible(timeout=15_000)
        expect(
            page.locator('#charts figure[data-chart="CPU"] path[data-series="cpu"]')
        ).to_have_attribute(
            "d", re.compile(r"M[\d.]+,[\d.]+ L[\d.]+,[\d.]+"), timeout=30_000
        )  # a drawn segment somewhere: a gap in the samples breaks the line
        # The agent's own log, picked by default on the node page.
        expect(page.locator("#log-lines")).to_contain_text("mirbad.agent", timeout=20_000)
        shot("05-node-page")

        # Keys: a create redirects; a reload shows nothing twice and makes no second key.
        before = len(api.get("/api/keys").json()["keys"])
        page.goto(f"{stack.url}/keys/")
        page.fill("input[name=name]", "browser-key")
        page.click("#create-key-button")
        page.wait_for_url(f"{stack.url}/keys/")
        expect(page.locator("#new-key-value")).to_have_text(re.compile(r"^mbd-"))
        page.reload()
        expect(page.locator("#new-key-value")).to_have_count(0)
        assert len(api.get("/api/keys").json()["keys"]) == before + 1
        shot("06-keys-reloaded")

        # The model editor: the estimate is there before anything is saved and changes
        # with the context size.
        page.goto(f"{stack.url}/models/new/")
        page.fill("#id_served_name", "tiny-ui")
        page.select_option("#id_source_node", "local")
        page.fill("#id_source_folder", "tiny")
        page.fill("#id_source_file", "tiny.gguf")
        page.fill("#id_context_size", "256")
        page.check("#place-local")
        line = page.locator("#estimate li.line").first
        expect(line).to_contain_text("needs", timeout=15_000)
        kv = page.locator("#estimate .breakdown td.kv").first
        small = kv.inner_text()
        page.fill("#id_context_size", "8192")
        expect(kv).not_to_have_text(small, timeout=15_000)  # before anything is saved
        expect(page.locator('#suggestions li[data-node="local"]')).to_contain_text("suitable")
        assert "needs" in line.inner_text()
        shot("07-editor-estimate")
        page.fill("#id_context_size", "256")  # the tiny model was trained on 512
        page.click("#save")
        page.wait_for_load_state()
        if not re.search(r"/models/\d+/$", page.url):
            shot("07b-editor-refused")
            errors = page.locator(".error").all_inner_texts()
            raise AssertionError(f"the editor did not save: {errors}")
        model_id = int(page.url.rstrip("/").rsplit("/", 1)[1])

        # Start from the Models list: Ready without a reload.
        page.goto(f"{stack.url}/models/")
        row = page.locator(f'tr[data-model="{model_id}"]')
        row.locator('button[data-action="start"]').click()
        page.wait_for_url(f"{stack.url}/models/")
        page.evaluate("window.__noReload = 3")
        expect(page.locator(f'tr[data-model="{model_id}"] .state')).to_contain_text(
            "Ready", timeout=90_000
        )
        assert page.evaluate("window.__noReload") == 3, "the Models page was reloaded"
        shot("08-models-ready")

        # Its engine's log on the model page: a line llama-server wrote, then a new one
        # that a request makes it write.
        page.goto(f"{stack.url}/models/{model_id}/")
        lines = page.locator("#log-lines")
        expect(lines).to_contain_text("llama", timeout=20_000)
        before_text = lines.inner_text()
        answer = api.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-ui",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        assert answer.status_code == 200, answer.text
        expect(lines).not_to_have_text(before_text, timeout=20_000)
        assert lines.inner_text().startswith(before_text[:200])  # appended, not replaced
        new_line = lines.inner_text()[len(before_text) :].strip().splitlines()[-1]
        page.fill("#log-search", "no-such-text-in-any-line")
        expect(lines).to_have_text("", timeout=5_000)
        page.fill("#log-search", new_line[:30])
        expect(lines).to_contain_text(new_line[:30], timeout=5_000)
        shot("09-engine-log")

        # A download started from the Downloads page, its progress followed live.
        hub.add_repo(
            "mirbad/ui-GGUF",
            {"ui.gguf": (stack.data / "models" / "tiny" / "tiny.gguf").read_bytes()},
        )
        page.goto(f"{stack.url}/downloads/")
        page.fill("#download-repo", "mirbad/ui-GGUF")
        page.fill("#download-variant", "ui.gguf")
        page.select_option("#download-node", "local")
        page.fill("#download-folder", "ui")
        page.click("#download-start-button")
        page.wait_for_url(f"{stack.url}/downloads/")
        download = page.locator('tr[data-download="local/ui"]')
        expect(download.locator(".state")).to_contain_text("Completed", timeout=60_000)
        expect(download.locator(".progress")).to_contain_text("(100 %)")
        shot("10-download")

        # The Usage page shows the request made above, once the router's meter wrote it.
        def metered() -> bool:
            rows = api.get("/api/usage").json()["usage"]
            return any(r["model"] == "tiny-ui" and r["requests"] >= 1 for r in rows)

        wait_for(metered, 20, "the usage flush")
        page.goto(f"{stack.url}/usage/?range=1h")
        expect(page.locator('#usage-models tr[data-model="tiny-ui"] .requests')).to_have_text(
            re.compile(r"^[1-9]"), timeout=15_000
        )
        shot("11-usage")

        # Backups: Back up now redirects and shows the one-time link once.
        page.goto(f"{stack.url}/backups/")
        page.fill("#id_passphrase", "a browser passphrase, long enough")
        page.click("#backup-now button[type=submit]")
        page.wait_for_url(f"{stack.url}/backups/")
        expect(page.locator("#backup-link")).to_have_attribute(
            "href", re.compile(r"^/api/backups/download/")
        )
        expect(page.locator("#backup-runs tbody")).to_contain_text("sealed, with CA")
        shot("12-backups")
        page.reload()
        expect(page.locator("#backup-link")).to_have_count(0)
        runs = api.get("/api/backups").json()["runs"]
        assert [r["kind"] for r in runs] == ["on_demand"] and runs[0]["hasCa"]

        browser.close()
    print(f"screenshots in {shots}")
    assert watch.problems == [], "\n".join(watch.problems)
