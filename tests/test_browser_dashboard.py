"""The dashboard and the chat page in a real browser: headless Chromium (Debian's package,
/usr/bin/chromium) driven by Playwright, against a real server with an API key and a few
streaming requests running in the background.

Skipped, saying why, where /usr/bin/chromium or the playwright package is missing (CI installs
the browser in .ci/run). Browsers are never downloaded (`playwright install` is not used).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from server_fixtures import running_server, small_settings

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
KEY = "sk-browser-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOCS_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "dashboard.png"
# A grammar that cannot end before 400 characters: each request runs until its max_tokens.
LOAD = {"model": "default", "messages": [{"role": "user", "content": "Describe the sea."}], "max_tokens": 60,
        "stream": True, "temperature": 0.8, "response_format": {"type": "json_schema", "json_schema": {
            "name": "long", "schema": {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}},
                                       "required": ["s"]}}}}  # fmt: skip
TIMEOUT_MS = 30_000

pytestmark = pytest.mark.browser

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(small_settings(api_keys=(KEY,), max_concurrency=4, max_context=256), smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Load:
    """`num_streams` threads, each sending streaming chat requests one after another until stopped."""

    def __init__(self, server, num_streams: int):
        self._server = server
        self._stop = threading.Event()
        self.num_done = 0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num_streams)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _run(self) -> None:
        with self._server.http(headers=AUTH) as client:
            while not self._stop.is_set():
                with client.stream("POST", "/v1/chat/completions", json=LOAD) as response:
                    assert response.status_code == 200
                    for _ in response.iter_lines():
                        if self._stop.is_set():
                            break
                self.num_done += 1


def wait_js(page, expression: str, timeout_s: float = TIMEOUT_MS / 1000) -> None:
    """Until `expression` is truthy in the page (polled from here: Playwright's own
    wait_for_function evaluates strings with eval, which the pages' CSP forbids, as it should)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {expression}")
        time.sleep(0.05)


def number(page, selector: str) -> float:
    text = page.inner_text(selector).replace(",", "").strip()
    return float("nan") if text in ("", "–") else float(text)


def console_errors(page) -> list[str]:
    """The page's console errors from now on (a CSP violation or a script error shows up here;
    the 401s the key prompt answers are expected and left out)."""
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and "status of 401" not in m.text and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def enter_key(page, key: str) -> None:
    page.wait_for_selector("#key-prompt:not([hidden])", timeout=TIMEOUT_MS)
    page.fill("#key-input", key)
    page.click("#key-save")


def test_dashboard_asks_for_the_key_then_shows_live_figures_under_load(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1440, "height": 1100})
    errors = console_errors(page)
    page.goto(server.url("/dashboard"))
    # The page asks for the key; a wrong one is refused and asked for again.
    enter_key(page, "sk-wrong")
    wait_js(page, "document.getElementById('key-message').textContent.includes('refused')")
    enter_key(page, KEY)
    page.wait_for_selector("#key-prompt[hidden]", state="attached", timeout=TIMEOUT_MS)
    wait_js(page, "document.getElementById('health').textContent === 'healthy'")
    assert page.inner_text("#fig-lanes") == "4" and page.inner_text("#model").startswith("SmolLM2-135M-Instruct")
    assert page.evaluate("sessionStorage.getItem('ninfer.apiKey')") == KEY
    assert page.inner_text("#fig-memory") != "–" and "host" in page.inner_text("#fig-memory-device")
    assert page.query_selector("#requests td.empty") is not None

    with Load(server, num_streams=3) as load:
        # The table fills with the requests in flight (ids, routes, counts; never text).
        wait_js(page, "document.querySelectorAll('#requests tr.request-row').length >= 2")
        row = page.inner_text("#requests tr.request-row")
        assert "/v1/chat/completions" in row and "Describe the sea" not in page.content()
        assert number(page, "#fig-running") >= 1
        # The counters move while requests run (the page polls twice a second).
        generated, steps = number(page, "#fig-generated-total"), number(page, "#fig-steps")
        wait_js(page, f"Number(document.getElementById('fig-generated-total').textContent.replace(/,/g, '')) > {generated}")
        wait_js(page, f"Number(document.getElementById('fig-steps').textContent.replace(/,/g, '')) > {steps}")
        wait_js(page, "Number(document.getElementById('fig-gen-tps').textContent) > 0")
        wait_js(page, "!isNaN(parseFloat(document.getElementById('fig-itl').textContent))")
        assert number(page, "#fig-kv-used") >= 1 and number(page, "#fig-kv-capacity") == 2048 / 16
        # TTFT: once a request of the load got its first token; then the charts have a few samples.
        wait_js(page, "!isNaN(parseFloat(document.getElementById('fig-ttft').textContent))")
        time.sleep(2.5)
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        if not DOCS_SCREENSHOT.exists() or os.environ.get("NINFER_UPDATE_SCREENSHOT") == "1":
            DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp_path / "dashboard.png", DOCS_SCREENSHOT)
    assert load.num_done >= 1
    # The table empties once the load stops.
    page.wait_for_selector("#requests td.empty", timeout=TIMEOUT_MS)
    assert page.query_selector("#requests tr.request-row") is None
    # The key stays for the tab: a reload asks for nothing.
    page.reload()
    wait_js(page, "document.getElementById('health').textContent === 'healthy'")
    assert page.is_hidden("#key-prompt")
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert errors == []


def test_chat_page_streams_the_models_reply(server, browser):
    context = browser.new_context()  # a new tab's sessionStorage: the key is asked for again
    page = context.new_page()
    errors = console_errors(page)
    page.goto(server.url("/"))
    assert page.url.endswith("/chat")
    enter_key(page, KEY)
    wait_js(page, "document.getElementById('model').textContent === 'SmolLM2-135M-Instruct'")
    page.fill("#max-tokens", "40")
    page.fill("#temperature", "0")
    page.fill("#prompt", "Write a short poem about rivers.")
    page.press("#prompt", "Enter")
    # Text appears while the reply is still streaming, then the reply completes.
    wait_js(page, "(() => { const m = document.querySelector('.msg.assistant.streaming');"
                  " return m !== null && m.textContent.length > 0; })()")  # fmt: skip
    page.wait_for_selector(".msg.assistant[data-done='true']", timeout=TIMEOUT_MS)
    shown = page.inner_text(".msg.assistant")
    assert page.inner_text("#error") == ""
    # The same request through the SDK gives the same (greedy) answer.
    expected = server.openai(KEY).chat.completions.create(
        model="default", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Write a short poem about rivers."}],
    ).choices[0].message.content  # fmt: skip
    assert shown.strip() == expected.strip() and len(expected) > 10
    assert errors == []
    context.close()
