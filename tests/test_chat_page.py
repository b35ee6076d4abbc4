"""The chat page (`GET /`, ggml_py/serving/chat_page.html) in a real headless browser: Debian's chromium driven by
selenium through chromedriver (`make browser` installs both; `make test` runs it first). A real `ggml-py serve` on
SmolLM2: the page shows the model's name, streams a greedy answer equal to the API's non-streamed one for the same
messages, carries the conversation into the next turn, starts over with New chat, stops a long generation (the
server cancels it), works with --api-key (the key typed into its settings), and a page of another origin is still
refused. Plus the page's response itself: self-contained, its Content-Security-Policy, the Host/Origin checks."""

from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
from serve_helpers import ServerProc

from ggml_py.models import default_model_path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
API_KEY = "s3cret-key-for-the-page"
SETTINGS = {"temperature": "0", "max-tokens": "24"}
Q1, Q2 = "What is the capital of France?", "And what is it famous for?"


@pytest.fixture(scope="module")
def server():
    s = ServerProc(default_model_path(), "--parallel", "2")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def keyed_server():
    s = ServerProc(default_model_path(), "--parallel", "2", "--api-key", API_KEY)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    assert not missing, f"{missing} missing: `make browser` installs Debian's chromium and chromium-driver"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM  # with the driver's path given too, selenium fetches nothing (no Selenium Manager)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--window-size=1200,900", "--disable-extensions", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-default-apps",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


# -- driving the page ------------------------------------------------------------------------------------------------
def open_page(driver, url: str, **settings: str) -> None:
    driver.get(url + "/")
    driver.execute_script("sessionStorage.clear(); localStorage.clear();")  # a previous test's settings
    driver.get(url + "/")
    # every chat request the page sends, recorded: what was asked for is checked, not only what came back
    driver.execute_script("""
        window.sentBodies = [];
        const orig = window.fetch;
        window.fetch = (url, init) => {
            if (String(url).includes("chat/completions")) window.sentBodies.push(init.body);
            return orig(url, init);
        };""")
    for name, value in settings.items():
        set_field(driver, name, value)


def set_field(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    el = driver.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value, Keys.TAB)  # TAB: the change event (settings saved, the API key applied)


def text_of(driver, css: str) -> str:
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
                                 css)


def wait_for(cond, timeout: float = 60.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def ask(driver, question: str) -> str:
    """Type a question, press Send, wait for the streamed answer to end: the answer as the page shows it."""
    from selenium.webdriver.common.by import By

    n = len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant"))
    driver.find_element(By.ID, "prompt").send_keys(question)
    driver.find_element(By.ID, "send").click()
    wait_for(lambda: driver.execute_script(
        "return document.body.dataset.state === 'idle' && document.querySelectorAll("
        "'#messages .msg.assistant[data-finish]').length > arguments[0];", n), what="the answer")
    return text_of(driver, "#messages .msg.assistant:last-child .text")


def sent(driver) -> list[dict]:
    return [json.loads(b) for b in driver.execute_script("return window.sentBodies;")]


def api_answer(server: ServerProc, messages: list[dict], **kw) -> tuple[str, int]:
    r = server.client(**kw).chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=24)
    return r.choices[0].message.content, r.usage.completion_tokens


# -- the tests -------------------------------------------------------------------------------------------------------
def test_the_page_is_self_contained_and_guarded(server, keyed_server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    # nothing from elsewhere: no external scripts, styles, fonts or images (and no markup-setting of model output)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(|<script\s+src""", html, re.I)
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", html)
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'", csp) and "unsafe-inline" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    # the page needs no key; the API still does
    assert httpx.get(keyed_server.url + "/").status_code == 200
    assert httpx.get(keyed_server.url + "/v1/models").status_code == 401
    # the Host and Origin checks cover the page as the API (DNS rebinding, another site's fetch)
    assert httpx.get(server.url + "/", headers={"Host": "evil.example"}).status_code == 403
    assert httpx.get(server.url + "/", headers={"Origin": "http://evil.example"}).status_code == 403


def test_chat_streams_the_api_answer_and_carries_the_conversation(server, browser):
    open_page(browser, server.url, **SETTINGS)
    model_id = server.client().models.list().data[0].id
    wait_for(lambda: text_of(browser, "#model-name") == model_id, 10, "the model's name")

    a1 = ask(browser, Q1)
    ref1, n1 = api_answer(server, [{"role": "user", "content": Q1}])
    assert a1 == ref1 and a1
    stats = text_of(browser, "#stats")
    assert re.search(rf"\b{n1} tokens · \d+\.\d tokens/s", stats), stats
    body = sent(browser)[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == 24

    a2 = ask(browser, Q2)
    msgs = [{"role": "user", "content": Q1}, {"role": "assistant", "content": ref1}, {"role": "user", "content": Q2}]
    assert sent(browser)[1]["messages"] == msgs
    assert a2 == api_answer(server, msgs)[0]
    assert [text_of(browser, f"#messages .msg:nth-child({i}) .text") for i in (1, 2, 3, 4)] == [Q1, a1, Q2, a2]

    # New chat: the conversation starts over (one message sent), the same greedy answer as the first time
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "new-chat").click()
    assert text_of(browser, "#messages") == "" and text_of(browser, "#stats") == ""
    assert ask(browser, Q1) == a1
    assert sent(browser)[2]["messages"] == [{"role": "user", "content": Q1}]
    assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None


def test_stop_cancels_the_generation(server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, server.url, temperature="0", **{"max-tokens": "2000"})
    browser.find_element(By.ID, "ignore-eos").click()  # 2000 tokens, whatever the model would say
    before = server.metrics()["requests_cancelled"]
    browser.find_element(By.ID, "prompt").send_keys("Tell me a very long story about a dragon.")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(text_of(browser, "#messages .msg.assistant .text") or "") > 20, 30, "some streamed text")
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: browser.execute_script("return document.body.dataset.state === 'idle'"), 10, "the stop")
    assert browser.find_element(By.CSS_SELECTOR, "#messages .msg.assistant").get_attribute("data-finish") == \
        "stopped"
    assert text_of(browser, "#stats").startswith("stopped")
    body = sent(browser)[0]
    assert body["max_tokens"] == 2000 and body["ignore_eos"] is True
    # the server saw the disconnect and cancelled the request: its sequence is free long before 2000 tokens
    wait_for(lambda: server.metrics()["requests_cancelled"] == before + 1, 10, "the server's cancel")
    m = server.metrics()
    assert m["active_sequences"] == 0 and m["queue_length"] == 0


def test_the_page_with_an_api_key(keyed_server, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, keyed_server.url, **SETTINGS)
    # without the key: the page loads, the model is unknown and the 401 is shown
    wait_for(lambda: "API key" in (text_of(browser, "#error") or ""), 10, "the 401 shown")
    assert text_of(browser, "#model-name") == "(model unknown)"
    browser.find_element(By.ID, "prompt").send_keys(Q1)
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: "HTTP 401" in text_of(browser, "#error"), 10, "the refused request's 401")
    # refused: the exchange is undone and the question put back for another try
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == Q1
    assert text_of(browser, "#messages") == ""

    set_field(browser, "api-key", API_KEY)
    model_id = keyed_server.client(api_key=API_KEY).models.list().data[0].id
    wait_for(lambda: text_of(browser, "#model-name") == model_id, 10, "the model's name with the key")
    browser.find_element(By.ID, "prompt").clear()
    assert ask(browser, Q1) == api_answer(keyed_server, [{"role": "user", "content": Q1}], api_key=API_KEY)[0]
    assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None


def test_another_origin_is_refused(server, browser):
    """A page of another origin (here http://localhost:PORT, the same server by another name) cannot start a
    generation on http://127.0.0.1:PORT: the JSON POST's preflight and a "simple" text/plain POST are both refused."""
    other = server.url.replace("127.0.0.1", "localhost")
    browser.get(other + "/")
    before = server.metrics()["requests_total"]
    outcome = browser.execute_async_script("""
        const done = arguments[arguments.length - 1], target = arguments[0], out = {};
        const body = JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 2});
        fetch(target, {method: "POST", headers: {"Content-Type": "application/json"}, body})
            .then((r) => { out.json = "status " + r.status; }, (e) => { out.json = e.name; })
            .then(() => fetch(target, {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
                                       body}))
            .then((r) => { out.simple = r.type; }, (e) => { out.simple = e.name; })
            .then(() => done(out));""", server.url + "/v1/chat/completions")
    assert outcome["json"] == "TypeError", outcome  # the preflight was refused (403): the fetch fails
    assert outcome["simple"] in ("opaque", "TypeError"), outcome
    assert server.metrics()["requests_total"] == before  # nothing was generated

