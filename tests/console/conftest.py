"""A real headless Chromium (Debian's ``chromium`` package, driven by Playwright through ``executable_path``:
Playwright's own browser download is not reachable here) and a server on the embedded model for the console
pages. ``.ci/run`` installs chromium and sets ``MM_SERVE_REQUIRE_BROWSER``, so CI fails instead of skipping
when it is missing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mm_serve.models.named_models import EMBEDDED_MODEL_DIR
from tests.api.server_process import ServerProcess, configured_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
API_KEY = "console-key"
# the image question (~75 tokens) fits; a long text question does not: a 429 queued_tokens to show
MAX_QUEUED_PROMPT_TOKENS = 200


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        if os.environ.get("MM_SERVE_REQUIRE_BROWSER"):
            pytest.fail(f"no chromium at {CHROMIUM} (.ci/run installs Debian's chromium)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root in a container, where Chromium's sandbox cannot start
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab whose every request is logged (``page.requests``); one for anywhere but 127.0.0.1 is
    aborted and recorded (``page.outside``): the pages must work cut off from any other host."""
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.requests, page.outside = [], []
    page.on("request", lambda request: page.requests.append(request.url))

    def refuse(route: Any) -> None:
        page.outside.append(route.request.url)
        route.abort()

    context.route(lambda url: not url.startswith(("http://127.0.0.1:", "data:")), refuse)
    try:
        yield page
    finally:
        context.close()


@pytest.fixture(scope="package")
def console_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded model behind an API key, with a small prefill-queue cap (a long question gets a 429) and
    quick restarts (the dashboard test kills a worker)."""
    config = {"api": {"api_key": API_KEY}, "admission": {"max_queued_prompt_tokens": MAX_QUEUED_PROMPT_TOKENS},
              "fault": {"heartbeat_timeout_s": 2.0, "restart_backoff_s": 0.5}}
    with configured_server(EMBEDDED_MODEL_DIR, config, tmp_path_factory.mktemp("console")) as proc:
        yield proc


def screenshot(page: Any, name: str, tmp_path: Path) -> None:
    """Save the page to ``$MM_SERVE_SCREENSHOTS/name`` (the README's pictures are made so), else under ``tmp_path``."""
    folder = Path(os.environ.get("MM_SERVE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=True)
