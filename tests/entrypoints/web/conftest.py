"""Fixtures for the web UI tests: one live `pagedllm serve` (default model, with an API key) for the whole
session, and headless Debian chromium driven by Playwright (`executable_path`, never `playwright install`).
Browser tests skip with the reason when Playwright or a chromium binary is missing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.entrypoints.openai.test_server import ServerProcess  # noqa: E402

API_KEY = "web-ui-key-7f3a"
# 90 KV blocks of 16 tokens: a burst of a few requests visibly fills the dashboard's grid.
SERVER_FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20), "--disable-log-requests"]
BROWSER_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
ARTIFACTS = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", Path(__file__).resolve().parents[3] / ".test-artifacts"))


def find_browser() -> str | None:
    """$PAGEDLLM_CHROMIUM, else the first chromium/chrome binary on PATH."""
    explicit = os.environ.get("PAGEDLLM_CHROMIUM")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for name in BROWSER_CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def scrape_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `/metrics`, keyed by (sample name, sorted labels without model_name)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def metric_value(url: str, name: str, **labels: str) -> float:
    return scrape_metrics(url)[(f"pagedllm:{name}", tuple(sorted(labels.items())))]


@pytest.fixture(scope="package")
def web_server() -> Iterator[ServerProcess]:
    with ServerProcess(["--api-key", API_KEY, *SERVER_FLAGS]) as srv:
        yield srv


# Package scope: Playwright's sync API keeps an asyncio loop running in this thread while it lives, so a
# session-scoped browser made every later test's asyncio.run() fail ("cannot be called from a running event loop").
@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser tests need the 'playwright' package (pip install playwright; no browser download)")
    path = find_browser()
    if path is None:
        pytest.skip(
            "browser tests need chromium: apt-get install chromium (scripts/setup.sh does it as root), "
            "or set PAGEDLLM_CHROMIUM to a Chrome/Chromium binary"
        )
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


class PageLog:
    """A browser page plus what it sent: every request (URL, headers) and every response status."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.responses: list[tuple[str, int]] = []
        page.on("request", lambda r: self.requests.append((r.url, r.headers)))
        page.on("response", lambda r: self.responses.append((r.url, r.status)))

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path))
        return path

    def enter_key(self, key: str) -> None:
        self.page.wait_for_selector("#key-prompt:not([hidden])", timeout=15_000)
        self.page.fill("#key-input", key)
        self.page.click("#key-form button[type=submit]")


@pytest.fixture
def new_page(browser: Any) -> Iterator[Any]:
    """Factory of pages, each in its own browser context (own sessionStorage / localStorage)."""
    contexts = []

    def make() -> PageLog:
        ctx = browser.new_context(viewport={"width": 1200, "height": 800})
        contexts.append(ctx)
        return PageLog(ctx.new_page())

    yield make
    for ctx in contexts:
        ctx.close()
