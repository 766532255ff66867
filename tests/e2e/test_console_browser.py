"""The Overview in headless Chromium updates live over the websocket, without a reload."""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.browser_support import launch, log_in, stack_with_hub

pytestmark = pytest.mark.slow


def test_overview_live(make_stack, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from playwright.sync_api import expect, sync_playwright

    # Long enough for the node page to connect before the rotation below ends.
    stack, hub, facts = stack_with_hub(
        make_stack, request, {"MIRBAD_ROTATION_PIN_GRACE_SECONDS": "4"}
    )
    api = stack.api(facts["API key"], timeout=30)

    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_context().new_page()  # more pages of the same session below
        log_in(page, stack, facts)
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        node_state = page.locator('tr[data-node="local"] .state .badge')
        expect(node_state).to_have_text("Online", timeout=15_000)
        page.evaluate("window.__noReload = 42")

        created = api.post(
            "/api/models",
            json={
                "servedName": "tiny",
                "sourceFolder": "tiny",
                "sourceFile": "tiny.gguf",
                "settings": {"context_size": 256, "gpu_layers": 0},
                "node": "local",
            },
        ).json()
        # The Models page beside the Overview, in the same session.
        models = page.context.new_page()
        models.goto(f"{stack.url}/models/")
        expect(models.locator("#live")).to_have_text("live", timeout=10_000)
        models.evaluate("window.__noReload = 42")
        assert api.post(f"/api/models/{created['id']}/start").status_code == 202
        model_state = models.locator(f'tr[data-model="{created["id"]}"] .state .badge')
        expect(model_state).to_have_text("Ready", timeout=60_000)
        # What the engine really uses arrives with the Ready event.
        measured = models.locator(f'tr[data-model="{created["id"]}"] .measured')
        expect(measured).to_have_text(re.compile(r"^\d+\.\d\d GiB$"), timeout=10_000)
        expect(page.locator("#tile-models")).to_contain_text("1 / 1", timeout=10_000)

        # A download's progress appears live, with a total because the hub sent sizes.
        hub.add_repo(
            "mirbad/live-GGUF",
            {"live.gguf": (stack.data / "models" / "tiny" / "tiny.gguf").read_bytes()},
        )
        downloads = page.context.new_page()
        downloads.goto(f"{stack.url}/downloads/")
        expect(downloads.locator("#live")).to_have_text("live", timeout=10_000)
        posted = api.post(
            "/api/downloads",
            json={"folder": "live", "repoId": "mirbad/live-GGUF", "variant": "live.gguf"},
        )
        assert posted.status_code == 202, posted.text
        download = downloads.locator('tr[data-download="local/live"]')
        expect(download.locator(".state")).to_have_text("Completed", timeout=30_000)
        expect(download.locator(".progress")).to_have_text(re.compile(r"\(100 %\)$"))
        cpu = page.locator('tr[data-node="local"] .cpu')
        expect(cpu).to_have_text(re.compile(r"\d+ %"), timeout=15_000)
        page.screenshot(path=str(tmp_path / "overview-ready.png"))

        # Stopped, not killed: `up` would restart a killed agent at once (D34), and
        # this checks that the page follows the monitor's 15 s Offline rule live.
        agent = psutil.Process(stack.pid("agent"))
        agent.suspend()
        try:
            t0 = time.monotonic()
            expect(node_state).to_have_text("Offline", timeout=30_000)
            expect(model_state).to_have_text("Offline", timeout=5_000)
            print(f"the page showed Offline {time.monotonic() - t0:.1f} s after SIGSTOP")
        finally:
            agent.resume()
        expect(node_state).to_have_text("Online", timeout=30_000)
        expect(model_state).to_have_text("Ready", timeout=15_000)
        assert page.evaluate("window.__noReload") == 42, "the page was reloaded"
        assert models.evaluate("window.__noReload") == 42, "the Models page was reloaded"

        # The node page: "Rotate certificate" there, then the rotation followed live
        # (Celery drives it; the pin grace holds it at CertIssued a few seconds) to the
        # new certificate, and the live cells equal what a reload renders.
        page.click('tr[data-node="local"] .id a')
        page.wait_for_url(f"{stack.url}/nodes/local/")
        serial = page.locator("#cert-serial").inner_text()
        assert re.fullmatch(r"[0-9a-f]+", serial), serial
        page.click('button[data-action="rotate"]')
        page.wait_for_url(f"{stack.url}/nodes/local/")
        stage = page.locator("#rotation-stage")
        expect(stage).not_to_have_text("none")  # rendered open, with its stage
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        page.evaluate("window.__noReload = 43")
        expect(stage).to_have_text("none", timeout=60_000)
        expect(page.locator("#cert-serial")).not_to_have_text(serial)
        assert page.evaluate("window.__noReload") == 43, "the node page was reloaded"
        live_cells = [page.locator(s).inner_html() for s in ("#certificate .cert", "#cert-serial",
                                                             "#cert-not-after", "#rotation-stage")]  # fmt: skip
        page.screenshot(path=str(tmp_path / "node-rotated.png"))
        page.reload()
        assert [page.locator(s).inner_html() for s in ("#certificate .cert", "#cert-serial",
                "#cert-not-after", "#rotation-stage")] == live_cells  # fmt: skip
        expect(page.locator("#audit")).to_contain_text("rotation.committed")
        browser.close()
