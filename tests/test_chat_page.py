"""The chat page of `dllama serve` (/) in a real headless Chromium: Debian's `chromium`, driven by
Playwright's Python package pointed at that binary (no browser is downloaded). The server is the
real CLI with two local workers and an API key, so the page has to ask for the key and the status
panel has three nodes to show. Only the XSS check stubs anything: the model will not write
`<script>` on demand, so that answer is a canned SSE stream fulfilled by the browser itself."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time

import pytest

from .server_helpers import cli_server, request, wait_until

CHROMIUM = os.environ.get("DLLAMA_CHROMIUM", "/usr/bin/chromium")
# what works in a container without a GPU, a sandbox or a network: nothing but the page's own traffic
LAUNCH_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]
KEY = "sk-chat-page-test"
DOCS_SCREENSHOT = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "chat-page.png")
STORY = "Write a long story about a lighthouse keeper and a storm."
QUESTION = "What is the capital of France?"


def _why_no_browser() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing (pip install -e '.[test]')"
    if shutil.which(CHROMIUM) is None:
        return f"no Chromium at {CHROMIUM} (as root: sh tests/browser/install_chromium.sh, which make test runs)"
    return None


pytestmark = [pytest.mark.skipif(_why_no_browser() is not None, reason=str(_why_no_browser()))]


@pytest.fixture(scope="module")
def server_url(model_path):
    """`dllama serve` with 2 local workers (3 nodes) and an API key."""
    with cli_server("--model", model_path, "--local-workers", "2", "--ctx-size", "1024", "--threads", "1",
                    "--sync-mode", "reduce", "--api-key", KEY) as (_proc, url):
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=30_000)  # a 2-core machine that also runs the model
    with sync_playwright() as pw:
        # Playwright gives every launch a fresh temporary profile (its --user-data-dir)
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(60_000)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    yield page
    context.close()
    assert not errors, errors  # the page's script never threw


def server_status(url: str) -> dict:
    status, _headers, text = request(url, "GET", "/status", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, text
    return json.loads(text)


def abandoned_chats(url: str) -> int:
    """Chat requests the server saw the client leave (status 499 in /metrics)."""
    status, _headers, text = request(url, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, text
    m = re.search(r'^dllama_requests_total\{endpoint="/v1/chat/completions",status="499"\} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_chat_streams_stops_and_survives_a_reload(server_url, page, tmp_path):
    """Key entry, 3 nodes in the panel, a streamed answer that grows, stopped mid-answer (the
    server cancels it), a second full answer whose speed the panel shows, and everything back
    after a reload."""
    from playwright.sync_api import expect

    page.goto(server_url + "/")
    # the server has a key: /status is refused until the user gives it
    expect(page.locator("#status-line")).to_contain_text("API key")
    expect(page.locator("#status-nodes li")).to_have_count(0)
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")
    nodes = page.locator("#status-nodes li.node.up")
    expect(nodes).to_have_count(3)
    workers = [n for n in server_status(server_url)["nodes"] if n["address"]]
    assert len(workers) == 2
    for worker in workers:
        expect(page.locator("#status-nodes")).to_contain_text(worker["address"])
    expect(page.locator("#status-nodes")).to_contain_text("share 33%")
    expect(page.locator("#status-figures")).to_contain_text("reduce · f32")

    # a long answer (greedy: it runs to the end of the context), stopped once it has grown a while
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "1000")
    send(page, STORY)
    answer = page.locator("#messages .msg.assistant").last
    stop = page.locator("#stop")
    lengths = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not lengths or lengths[-1] < 300):
        lengths.append(len(answer.inner_text()))
        time.sleep(0.05)  # often enough to see several pieces arrive even on a fast machine
    assert stop.is_visible(), "the answer ended before it could be stopped"
    increases = sum(later > earlier for earlier, later in zip(lengths, lengths[1:]))
    assert increases >= 3 and lengths[-1] > lengths[0], lengths  # the text arrived in pieces
    assert server_status(server_url)["running"] == 1
    stop.click()
    expect(page.locator("#send")).to_be_visible()
    expect(answer).to_contain_text("(stopped)")
    # the fetch was aborted, so the server cancelled the generation: free at once, not after 1000 tokens
    assert wait_until(lambda: server_status(server_url)["running"] == 0, 10)
    assert wait_until(lambda: abandoned_chats(server_url) == 1, 10)
    stopped_text = answer.inner_text()
    time.sleep(1)
    assert answer.inner_text() == stopped_text  # nothing arrives after the stop

    # a short answer that finishes: the panel shows its speed and every node's figures
    page.fill("#max-tokens", "40")
    send(page, QUESTION)
    expect(page.locator("#send")).to_be_visible(timeout=120_000)
    second_answer = page.locator("#messages .msg.assistant").last.inner_text()
    assert "Paris" in second_answer and "(stopped)" not in second_answer
    figures = page.locator("#status-figures")
    expect(figures).to_contain_text(re.compile(r"last answer\s*[1-9][\d.]* tok/s"))
    expect(figures).to_contain_text(re.compile(r"compute [\d.]+ ms \(\d+%\) · sync [\d.]+ ms"))
    expect(figures).to_contain_text("0 waiting · 0 running")
    for i in range(3):
        expect(nodes.nth(i)).to_contain_text(re.compile(r"[\d.]+ ms/token.*RSS \d+ MB"))
    page.screenshot(path=tmp_path / "chat-page.png")
    if os.environ.get("DLLAMA_UPDATE_SCREENSHOT") or not os.path.exists(DOCS_SCREENSHOT):
        page.screenshot(path=DOCS_SCREENSHOT)  # the README's picture (a test run leaves the tree clean)

    page.reload()
    messages = page.locator("#messages .msg")
    expect(messages).to_have_count(4)
    assert messages.nth(0).inner_text().endswith(STORY)
    assert messages.nth(1).inner_text() == stopped_text
    assert messages.nth(2).inner_text().endswith(QUESTION)
    assert messages.nth(3).inner_text() == second_answer
    # the settings and the key came back too: the panel is filled without asking again
    assert page.input_value("#max-tokens") == "40" and page.input_value("#temperature") == "0"
    expect(nodes).to_have_count(3)

    page.click("#new-chat")
    expect(messages).to_have_count(0)
    page.reload()
    expect(page.locator("#empty-hint")).to_be_visible()
    expect(messages).to_have_count(0)


# an answer that would run script if the page put model text into innerHTML; split mid-tag across
# SSE events, as tokens would be
HOSTILE_PIECES = ["Look: <scr",
                  "ipt>window.__pwned = 'script'</script> and <img src=x onerror=\"window.__pwned = 'img'\">",
                  " done.\n\n**bold <b>claim</b>** and `<i>code</i>`\n\n",
                  "```html\n<script>window.__pwned = 'fence'</script>\n",
                  "```\n\n- <svg onload=\"window.__pwned = 'svg'\"></svg> item\n"]


def canned_stream(pieces: list[str]) -> str:
    chunk = lambda delta, finish=None: {"object": "chat.completion.chunk",  # noqa: E731
                                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    events = [chunk({"role": "assistant"})] + [chunk({"content": p}) for p in pieces] + [chunk({}, "stop")]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_model_markup_is_shown_as_text(server_url, page):
    """A model answer holding <script>, <img onerror> and <svg onload> (in text, in inline code,
    in a fenced block, in a list) is shown as those characters: no element is made from it and no
    script runs, when it streams in and when the stored conversation is shown after a reload."""
    from playwright.sync_api import expect

    sent = []

    def fulfil(route):
        sent.append((route.request.headers.get("authorization"), route.request.post_data_json))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=canned_stream(HOSTILE_PIECES))

    page.route("**/v1/chat/completions", fulfil)
    page.goto(server_url + "/")
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")
    page.click("#new-chat")
    send(page, "Say something dangerous.")
    answer = page.locator("#messages .msg.assistant").last
    expect(answer).to_contain_text("item")
    expect(page.locator("#send")).to_be_visible()
    authorization, body = sent[0]
    assert authorization == f"Bearer {KEY}" and body["stream"] is True
    assert body["messages"][-1] == {"role": "user", "content": "Say something dangerous."}

    for when in ("streamed", "after a reload"):
        text = answer.inner_text()
        assert "<script>window.__pwned = 'script'</script>" in text, (when, text)
        assert "<img src=x onerror=\"window.__pwned = 'img'\">" in text, (when, text)
        assert "<svg onload=\"window.__pwned = 'svg'\"></svg> item" in text, (when, text)
        assert answer.locator("script, img, svg, b, i").count() == 0, when
        # the markdown around it is real markup, made by the page
        expect(answer.locator("strong")).to_have_text("bold <b>claim</b>")
        expect(answer.locator("p code")).to_have_text("<i>code</i>")
        expect(answer.locator("pre code")).to_have_text("<script>window.__pwned = 'fence'</script>")
        expect(answer.locator("li")).to_have_text("<svg onload=\"window.__pwned = 'svg'\"></svg> item")
        assert page.evaluate("typeof window.__pwned") == "undefined", when
        page.reload()
        answer = page.locator("#messages .msg.assistant").last
        expect(answer).to_contain_text("item")


def test_phone_width_has_no_horizontal_overflow(server_url, browser, tmp_path):
    """At 390x844 (a phone, mobile viewport rules) nothing sticks out sideways: not a long code
    line, not an unbroken word, not the open panels with the nodes' addresses."""
    from playwright.sync_api import expect

    long_line = "x = [" + ", ".join(str(i) for i in range(80)) + "]"
    conversation = {"messages": [
        {"role": "user", "content": "Show me a long line " + "W" * 120},
        {"role": "assistant", "content": f"Here:\n\n```python\n{long_line}\n```\n\n- a list item `{'y' * 90}`\n"},
    ]}
    storage = {"cookies": [], "origins": [{"origin": server_url, "localStorage": [
        {"name": "dllama.conversation.v1", "value": json.dumps(conversation)},
        {"name": "dllama.apiKey", "value": json.dumps(KEY)}]}]}
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                                  device_scale_factor=2, storage_state=storage)
    try:
        page = context.new_page()
        page.goto(server_url + "/")
        expect(page.locator("#messages .msg")).to_have_count(2)
        scroll_width = "document.documentElement.scrollWidth"
        assert page.evaluate(scroll_width) <= 390
        send_box = page.locator("#send").bounding_box()
        assert send_box["x"] + send_box["width"] <= 390
        page.click("#status summary")
        page.click("#settings summary")
        expect(page.locator("#status-nodes li.node.up")).to_have_count(3)
        assert page.evaluate(scroll_width) <= 390
        page.screenshot(path=tmp_path / "chat-page-phone.png", full_page=True)
    finally:
        context.close()
