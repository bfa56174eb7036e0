"""The chat page in headless chromium against a live `pagedllm serve` (acceptance 1, 3, 4)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.entrypoints.web.conftest import API_KEY, metric_value

PAGE_TIMEOUT = 60_000

# A live server (~1 min to start on the shared 2-core box) plus a browser: too slow for CI.
pytestmark = pytest.mark.slow


def wait_metric(url: str, name: str, want: float, timeout: float = 20.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    value = metric_value(url, name, **labels)
    while value != want and time.monotonic() < deadline:
        time.sleep(0.1)
        value = metric_value(url, name, **labels)
    return value


def assert_key_never_in_urls(log: Any) -> None:
    assert log.requests, "no requests recorded"
    for url, _ in log.requests:
        assert API_KEY not in url, url


def test_chat_streams_stops_and_keeps_conversation(web_server: Any, new_page: Any) -> None:
    log = new_page()
    page = log.page
    page.goto(web_server.url + "/")
    log.enter_key(API_KEY)
    page.wait_for_function("document.querySelector('#model').options.length > 0", timeout=PAGE_TIMEOUT)
    assert page.input_value("#model") == "SmolLM2-135M-Instruct"
    page.fill("#max-tokens", "400")
    page.fill("#temperature", "0")

    page.fill("#prompt", "Write a very long story about a dragon who learns to bake bread.")
    page.press("#prompt", "Enter")
    answer = ".msg.assistant:last-child .content"
    page.wait_for_function(f"document.querySelector('{answer}').textContent.length >= 20", timeout=PAGE_TIMEOUT)
    first = page.text_content(answer)
    # Streamed: the same answer keeps growing while the request runs on the server.
    page.wait_for_function(
        f"document.querySelector('{answer}').textContent.length > {len(first)}", timeout=PAGE_TIMEOUT
    )
    assert metric_value(web_server.url, "num_requests_running") == 1
    log.screenshot("chat_streaming")
    page.click("#stop")
    assert wait_metric(web_server.url, "num_requests_running", 0) == 0
    page.wait_for_selector("#send:not([hidden])")
    stats = page.text_content(".msg.assistant:last-child .stats")
    assert "stopped" in stats and "tok/s" in stats, stats
    partial = page.text_content(answer)
    assert len(partial) >= len(first)

    # A complete answer shows its token rate.
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "Say hello.")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "document.querySelectorAll('.msg.assistant').length == 2 && "
        "/tok\\/s/.test(document.querySelector('.msg.assistant:last-child .stats').textContent) && "
        "!document.querySelector('#send').hidden",
        timeout=PAGE_TIMEOUT,
    )
    assert "stopped" not in page.text_content(".msg.assistant:last-child .stats")
    texts = page.eval_on_selector_all(".msg .content", "els => els.map(e => e.textContent)")

    page.reload()
    page.wait_for_function("document.querySelectorAll('.msg').length == 4", timeout=PAGE_TIMEOUT)
    assert page.eval_on_selector_all(".msg .content", "els => els.map(e => e.textContent)") == texts
    assert texts[1] == partial
    log.screenshot("chat_reloaded")
    # The key stays in this tab's session storage, never in local storage or a URL.
    assert page.evaluate("sessionStorage.getItem('pagedllm.apiKey')") == API_KEY
    assert API_KEY not in page.evaluate("JSON.stringify(localStorage)")
    assert_key_never_in_urls(log)
    assert wait_metric(web_server.url, "num_requests_running", 0) == 0


def sse(chunks: list[str]) -> str:
    events = [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]} for c in chunks]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


HOSTILE = [
    "Look: <script>window.__xss = 1</script>",
    ' and <img src="x" onerror="window.__xss = 2"> and **bold** `<b>inline</b>`\n\n',
    "```html\n<script>window.__xss = 3</script>\n```\n",
]


def test_model_output_renders_as_text(web_server: Any, new_page: Any) -> None:
    """The answer stream is replaced (page.route) by model output carrying markup: it must show as text."""
    log = new_page()
    page = log.page
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse(HOSTILE)),
    )
    page.goto(web_server.url + "/")
    log.enter_key(API_KEY)
    page.fill("#prompt", "Show me some HTML.")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelector('.msg.assistant .stats').textContent.includes('tokens')")
    for _ in range(2):  # as streamed, then as restored from local storage
        msg = page.locator(".msg.assistant .content")
        text = msg.text_content()
        assert "<script>window.__xss = 1</script>" in text
        assert '<img src="x" onerror="window.__xss = 2">' in text
        assert "<script>window.__xss = 3</script>" in msg.locator("pre code").text_content()
        assert msg.locator("script, img, b").count() == 0
        assert msg.locator("strong").text_content() == "bold"
        assert msg.locator("p code").text_content() == "<b>inline</b>"
        page.wait_for_timeout(300)  # an <img onerror> would have fired by now
        assert page.evaluate("window.__xss") is None
        page.reload()
        page.wait_for_selector(".msg.assistant .content")
    log.screenshot("chat_xss_as_text")


def test_api_key_prompt_and_network_log(web_server: Any, new_page: Any) -> None:
    for path, api in (("/", "/v1/models"), ("/dashboard", "/dashboard/api/stats")):
        log = new_page()
        page = log.page
        page.goto(web_server.url + path)
        # Static page loads without the key; its first API call gets 401 and the page asks for the key.
        page.wait_for_selector("#key-prompt:not([hidden])", timeout=PAGE_TIMEOUT)
        assert (web_server.url + path, 200) in log.responses
        assert (web_server.url + api, 401) in log.responses
        log.screenshot("key_prompt_" + path.strip("/") if path != "/" else "key_prompt_chat")
        log.enter_key("wrong-key")
        page.wait_for_function("document.querySelector('#key-reason').textContent.includes('refused')")
        n = len(log.responses)
        log.enter_key(API_KEY)
        page.wait_for_function("document.querySelector('#key-prompt').hidden", timeout=PAGE_TIMEOUT)
        page.wait_for_timeout(1500)
        ok = [(u, s) for u, s in log.responses[n:] if u == web_server.url + api]
        assert ok and all(s == 200 for _, s in ok), ok
        sent = [h for u, h in log.requests if u == web_server.url + api]
        assert sent[-1].get("authorization") == f"Bearer {API_KEY}"
        assert_key_never_in_urls(log)
