"""Headless Chromium for the chat page tests: Debian's `chromium` package driven by Playwright for Python.

The fixtures skip, saying why, when `/usr/bin/chromium` (or `PEREGRINE_CHROMIUM`) or the `playwright` package
is missing; `scripts/setup.sh` installs both where it can. Playwright's own browser downloads are never used.
Import `browser_fixture` and `page_fixture` into a test module to use the `browser` and `page` fixtures. Each test's page is screenshotted at its end, to a path the test prints (`pytest -s` shows it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("PEREGRINE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
WAIT_MS = 300_000  # page-side waits: generation on a busy 2-core machine can be slow


@pytest.fixture(name="browser", scope="module")
def browser_fixture() -> Iterator[object]:
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"chromium is not installed ({CHROMIUM} missing): apt-get install chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with sync_api.sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        launched = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(name="page")
def page_fixture(browser, tmp_path: Path) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    try:
        yield pg
    finally:
        shot = tmp_path / "chat-page-last.png"
        pg.screenshot(path=str(shot))
        print(f"\nchat page screenshot: {shot}")
        context.close()
