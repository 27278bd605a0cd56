"""The web page in a real browser: Playwright driving Debian's chromium headless (``.ci/run``
installs it; without it these tests skip). One browser for the module; every page fails
its test on any console error, uncaught exception or Content-Security-Policy violation.

``ORTSERVE_SCREENSHOTS=1`` writes the guide's screenshots to docs/images/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from audio import TINY_WHISPER, tone_wav
from images import TINY_PHI3V, image_bytes
from ortserve_server import ServerConfig, create_app
from ortserve_server._config import McpServer
from playwright.sync_api import expect
from serving import TINY_MODEL, running
from test_cli import start_server, stop
from voices import JOE

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOOLS_SERVER = Path(__file__).resolve().parents[1] / "mcp_tools_server.py"
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium to drive: apt-get install chromium (.ci/run installs it)"
)

# Reports CSP violations as console errors, which the page fixture fails on (Playwright's
# init scripts run outside the page's CSP).
WATCH_CSP = """
document.addEventListener("securitypolicyviolation", (e) =>
  console.error(`CSP violation: ${e.violatedDirective} ${e.blockedURI}`));
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # A fake microphone (a tone), granted without a prompt: the dictation test records it.
        fake_microphone = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=fake_microphone)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = ServerConfig(
        models={"tiny": TINY_MODEL, "vision": TINY_PHI3V, "think": FIXTURES / "tiny-qwen3-think"},
        ui=True,
        state_dir=tmp_path_factory.mktemp("state"),
        # The MCP test server over stdio; one call per response, so that a forced call is the only one.
        mcp_servers=(McpServer("tools", command=(sys.executable, str(TOOLS_SERVER), "stdio")),),
        mcp_max_tool_calls=1,
    )
    with running(create_app(config)) as base:
        yield base


class Tab:
    """A browser context (its own sessionStorage) and page, with the errors it logged."""

    def __init__(self, browser: Any) -> None:
        self.context = browser.new_context(viewport={"width": 1200, "height": 800})
        self.context.add_init_script(WATCH_CSP)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(f"{message.text} ({message.location.get('url')})")

    def open(self, url: str, key: str | None = None) -> Any:
        page = self.page
        page.goto(url)
        if key is not None:
            page.get_by_label("Key", exact=True).fill(key)
            page.get_by_role("button", name="Use this key").click()
        page.wait_for_selector("body[data-ready]", state="attached")
        return page


@pytest.fixture
def tab(browser: Any) -> Iterator[Tab]:
    opened = Tab(browser)
    yield opened
    opened.context.close()
    assert opened.errors == []


def send(page: Any, text: str, *, model: str = "tiny", tokens: int | None = None) -> Any:
    """Type ``text`` and press Enter; the reply's element once it is complete."""
    page.get_by_label("Model", exact=True).select_option(model)
    if tokens is not None:
        if page.locator("#settings").get_attribute("open") is None:
            page.get_by_text("System prompt and sampling").click()
        page.get_by_label("Max tokens").fill(str(tokens))
        page.get_by_label("Min tokens").fill(str(tokens))
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")
    reply = page.locator(".message.assistant").last
    expect(reply).to_have_class(re.compile(r"\bdone\b"), timeout=30_000)
    return reply


# A PNG (bytes as a list) pasted into the message box, or dropped on the composer, as a
# browser's clipboard or drag and drop hands it over.
PUT_IMAGE = """([kind, bytes]) => {
  const data = new DataTransfer();
  data.items.add(new File([new Uint8Array(bytes)], "blue.png", {type: "image/png"}));
  const target = document.querySelector(kind === "paste" ? "#prompt" : "#composer");
  const event = kind === "paste"
    ? new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true})
    : new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true});
  target.dispatchEvent(event);
}"""


def _card(url: str, model: str) -> Any:
    return httpx.get(f"{url}/v1/models/{model}").json()


def screenshot(page: Any, name: str) -> None:
    if os.environ.get("ORTSERVE_SCREENSHOTS"):
        DOCS_IMAGES.mkdir(exist_ok=True)
        page.screenshot(path=str(DOCS_IMAGES / name))


def test_a_reply_streams_and_the_conversation_is_there_after_a_reload(tab: Tab, url: str) -> None:
    page = tab.open(url)
    # The reply's text, each time the page changes it: it must grow in steps, not arrive whole.
    page.evaluate(
        """() => { window.lengths = [];
        new MutationObserver(() => {
          const reply = document.querySelector(".message.assistant .content");
          if (reply) window.lengths.push(reply.textContent.length);
        }).observe(document.querySelector("#messages"), {subtree: true, childList: true, characterData: true}); }"""
    )
    prompt = page.get_by_label("Message", exact=True)
    prompt.fill("first line")
    prompt.press("Shift+Enter")  # a new line, not a send
    prompt.type("second line")
    assert prompt.input_value() == "first line\nsecond line"
    assert page.locator(".message").count() == 0
    reply = send(page, prompt.input_value(), model="vision", tokens=300)  # og-generator: slow enough to watch
    lengths = sorted(set(page.evaluate("window.lengths")) - {0})
    assert len(lengths) >= 3, f"the reply did not stream: lengths seen {lengths}"
    stats = reply.locator(".stats").inner_text()
    assert "300 tokens" in stats and "tokens/s" in stats and "first token" in stats and "cached" in stats
    answer = reply.locator(".content").inner_text()
    assert page.locator(".message.user .content").inner_text() == "first line\nsecond line"

    page.reload()
    page.wait_for_selector("body[data-ready]", state="attached")
    listed = page.locator("#conversations li")
    assert listed.count() >= 1
    assert "first line" in listed.first.inner_text()
    page.get_by_role("button", name="New chat").click()
    assert page.locator(".message").count() == 0
    listed.first.get_by_role("button").first.click()
    page.locator(".message.assistant").wait_for()
    assert page.locator(".message.assistant .content").inner_text() == answer
    assert page.locator(".message.user .content").inner_text() == "first line\nsecond line"


def test_stop_ends_the_reply_and_the_server_frees_the_model(tab: Tab, url: str) -> None:
    page = tab.open(url)
    page.get_by_label("Model", exact=True).select_option("vision")
    page.get_by_text("System prompt and sampling").click()
    page.get_by_label("Max tokens").fill("3000")
    page.get_by_label("Min tokens").fill("3000")
    page.get_by_label("Message", exact=True).fill("tell me a long story")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".message.assistant .content")).not_to_have_text("")
    page.get_by_role("button", name="Stop").click()
    reply = page.locator(".message.assistant.done")
    reply.wait_for()
    stats = reply.locator(".stats").inner_text()
    assert "stopped" in stats
    assert page.get_by_role("button", name="Send").is_visible()
    deadline = time.monotonic() + 5
    while _card(url, "vision")["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _card(url, "vision")["in_flight"] == 0


def test_opening_another_conversation_mid_reply_keeps_each_where_it_belongs(tab: Tab, url: str) -> None:
    page = tab.open(url)
    send(page, "the older conversation", tokens=4)
    older = page.evaluate("location.hash.slice(1)")
    page.get_by_role("button", name="New chat").click()
    page.get_by_label("Model", exact=True).select_option("vision")
    page.get_by_label("Max tokens").fill("3000")
    page.get_by_label("Min tokens").fill("3000")
    page.get_by_label("Message", exact=True).fill("the newer conversation")
    page.get_by_label("Message", exact=True).press("Enter")
    expect(page.locator(".message.assistant .content")).not_to_have_text("")
    page.locator(f"#conversations li[data-id={older}] .open").click()  # the reply under way stops
    expect(page.locator(".message.user .content")).to_have_text("the older conversation")
    expect(page.locator("#conversations")).to_contain_text("the newer conversation")
    listed = {c["title"]: c for c in httpx.get(f"{url}/v1/ui/conversations").json()["data"]}
    assert listed["the newer conversation"]["message_count"] == 2  # its partial reply, kept with it
    assert listed["the older conversation"]["message_count"] == 2
    assert page.evaluate("location.hash.slice(1)") == older


def test_an_image_goes_to_the_vision_model(tab: Tab, url: str, tmp_path: Path) -> None:
    page = tab.open(url)
    page.get_by_label("Model", exact=True).select_option("vision")
    assert "image" in page.locator("#model-takes").inner_text()
    picture = tmp_path / "red.png"
    picture.write_bytes(image_bytes())
    # Pasted and dropped files are attached too; then one is removed again.
    for event in ("paste", "drop"):
        page.evaluate(PUT_IMAGE, [event, list(image_bytes(colour=(20, 20, 200)))])
    expect(page.locator("#attachments img")).to_have_count(2)
    page.get_by_role("button", name="Remove this attachment").first.click()
    page.locator("#attach").set_input_files(str(picture))
    expect(page.locator("#attachments img")).to_have_count(2)
    send(page, "what is in this picture?", model="vision", tokens=8)
    assert page.locator(".message.user img").count() == 2
    assert page.locator("#attachments img").count() == 0
    page.get_by_text("System prompt and sampling").click()  # closed again, for the screenshot
    screenshot(page, "web-page-chat.png")
    conversation_id = page.evaluate("location.hash.slice(1)")
    kept = httpx.get(f"{url}/v1/ui/conversations/{conversation_id}").json()
    parts = kept["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")

    # A text-only model offers no Attach, and refuses a pasted image before anything is sent.
    page.get_by_label("Model", exact=True).select_option("tiny")
    assert page.locator("#attach").is_disabled() and page.locator("#attach-label").is_hidden()
    page.evaluate(PUT_IMAGE, ["paste", list(image_bytes())])
    expect(page.get_by_role("status")).to_contain_text("does not take images")


def test_the_server_view_lists_models_loads_and_plots(tab: Tab, url: str) -> None:
    page = tab.open(url)
    page.get_by_role("button", name="Server").click()
    row = page.locator("#models tr[data-model=tiny]")
    row.wait_for()
    assert "ready" in row.inner_text() and "ort-cpu" in row.inner_text()
    expect(page.locator("#plot-now")).to_contain_text("tokens/s")
    # Traffic shows on the plot: its peak is read from /metrics' token counter.
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900, "min_tokens": 900}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    expect(page.locator("#plot-now")).to_contain_text(re.compile(r"peak [1-9]\d*\.\d tokens/s"))
    state = page.locator("#models tr[data-model=tiny] td").nth(2)
    row.get_by_role("button", name="Unload tiny").click()
    expect(state).to_have_text("unloaded")
    assert _card(url, "tiny")["status"] == "unloaded"
    page.locator("#models tr[data-model=tiny]").get_by_role("button", name="Load tiny").click()
    expect(state).to_have_text("ready", timeout=20_000)
    screenshot(page, "web-page-server.png")


def test_edit_regenerate_rename_search_export_delete_import(tab: Tab, url: str, tmp_path: Path) -> None:
    page = tab.open(url)
    send(page, "alpha question", tokens=4)
    conversation_id = page.evaluate("location.hash.slice(1)")

    def kept() -> Any:
        return httpx.get(f"{url}/v1/ui/conversations/{conversation_id}").json()

    first_reply = kept()["messages"][1]
    page.get_by_role("button", name="Regenerate this reply").click()
    expect(page.locator(".message.assistant")).to_have_class(re.compile(r"\bdone\b"))
    assert page.locator(".message").count() == 2
    assert len(kept()["messages"]) == 2 and kept()["messages"][1]["stats"] != first_reply["stats"]

    page.get_by_role("button", name="Edit this message").click()
    page.get_by_label("Edit the message").fill("beta question")
    page.get_by_role("button", name="Send edited").click()
    expect(page.locator(".message.assistant")).to_have_class(re.compile(r"\bdone\b"))
    assert kept()["messages"][0]["content"] == "beta question" and len(kept()["messages"]) == 2

    item = page.locator(f"#conversations li[data-id={conversation_id}]")
    item.get_by_role("button", name="Rename").click()
    page.get_by_label("New title").fill("Renamed chat")
    page.get_by_label("New title").press("Enter")
    expect(item).to_contain_text("Renamed chat")
    assert kept()["title"] == "Renamed chat"

    search = page.get_by_label("Search conversations")
    search.fill("BETA")
    expect(page.locator("#conversations li")).to_have_count(1)
    search.fill("no such words")
    expect(page.locator("#conversations li")).to_have_count(0)
    search.fill("")
    expect(item).to_be_visible()

    with page.expect_download() as download:
        page.get_by_role("button", name="Export").click()
    exported = tmp_path / "export.json"
    download.value.save_as(exported)
    assert "Renamed chat" in [c["title"] for c in json.loads(exported.read_text())["data"]]

    item.get_by_role("button", name="Delete").click()
    expect(item).to_have_count(0)
    assert httpx.get(f"{url}/v1/ui/conversations/{conversation_id}").status_code == 404
    count = len(json.loads(exported.read_text())["data"])
    page.locator("#import-file").set_input_files(str(exported))
    expect(page.get_by_role("status")).to_have_text(f"imported {count} conversation{'s' if count > 1 else ''}")
    expect(page.locator("#conversations")).to_contain_text("Renamed chat")


def test_reasoning_shows_in_its_own_block(tab: Tab, url: str) -> None:
    page = tab.open(url)
    page.get_by_label("Model", exact=True).select_option("think")
    assert "reasoning" in page.locator("#model-takes").inner_text()
    reply = send(page, "think about it", model="think", tokens=6)
    block = reply.locator("details.reasoning")
    expect(block).to_be_visible()
    assert block.get_attribute("open") is None  # folded until asked
    block.locator("summary").click()
    assert block.locator(".reasoning-text").inner_text().strip()


def test_controls_have_labels_and_focus_shows(tab: Tab, url: str) -> None:
    page = tab.open(url)
    page.get_by_role("button", name="Server").click()
    page.locator("#models tbody tr").first.wait_for()
    page.get_by_role("button", name="Chat").click()
    unlabelled = page.evaluate(
        """() => [...document.querySelectorAll("input, select, textarea, button")]
        .filter((e) => !e.closest("[hidden]") && !(e.labels?.length || e.getAttribute("aria-label")
                       || (e.tagName === "BUTTON" && e.textContent.trim())))
        .map((e) => e.outerHTML)"""
    )
    assert unlabelled == []
    page.get_by_role("button", name="New chat").focus()
    page.keyboard.press("Tab")
    focused = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert focused != "none"


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_tool_calls_show_as_they_stream_and_their_results_go_back(tab: Tab, url: str) -> None:
    page = tab.open(url)
    page.get_by_text("System prompt and sampling").click()
    tools = page.get_by_label("Tools (the chat API's tools list")
    tools.fill("[not json")
    page.get_by_label("Message", exact=True).fill("weather in Paris?")
    page.get_by_label("Message", exact=True).press("Enter")
    expect(page.get_by_role("status")).to_contain_text("Tools: not JSON")
    assert page.locator(".message").count() == 0  # nothing sent, the message still in the box
    tools.fill(json.dumps(WEATHER))
    page.get_by_label("Tool choice").select_option("required")  # the tiny model calls it under a grammar
    reply = send(page, "weather in Paris?", tokens=40)
    call = reply.locator(".tool-call")
    expect(call.locator("summary")).to_have_text("Tool call: get_weather")
    assert call.locator("pre").inner_text().startswith('{"city":')

    page.get_by_label("Tool choice").select_option("none")
    page.get_by_label("Result of get_weather").fill("sunny, 21 °C")
    page.get_by_role("button", name="Send results").click()
    expect(page.locator(".message.tool .content")).to_have_text("sunny, 21 °C")
    expect(page.locator(".message.assistant").last).to_have_class(re.compile(r"\bdone\b"))
    kept = httpx.get(f"{url}/v1/ui/conversations/{page.evaluate('location.hash.slice(1)')}").json()
    roles = [m["role"] for m in kept["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert kept["messages"][2]["tool_call_id"] == kept["messages"][1]["tool_calls"][0]["id"]
    assert kept["settings"]["tool_choice"] == "none" and kept["settings"]["tools"] == WEATHER


def test_mcp_calls_run_on_the_server_and_show_with_their_output(tab: Tab, url: str) -> None:
    page = tab.open(url)
    page.get_by_text("System prompt and sampling").click()
    page.get_by_label("tools", exact=True).check()
    page.get_by_label("Tool choice").select_option("required")  # the tiny model calls under a grammar
    reply = send(page, "use one of your tools", tokens=40)
    call = reply.locator(".mcp-call")
    expect(call).to_have_count(1)
    summary = call.locator("summary").inner_text()
    assert re.fullmatch(r"MCP call: tools\.\w+ \((completed|failed)\)", summary), summary
    conversation = page.evaluate("location.hash.slice(1)")
    kept = httpx.get(f"{url}/v1/ui/conversations/{conversation}").json()["messages"][1]["mcp_calls"][0]
    assert kept["server_label"] == "tools" and summary.startswith(f"MCP call: tools.{kept['name']} ")
    assert call.locator(".arguments").inner_text() == kept["arguments"]
    error = kept["error"]
    if isinstance(error, dict):  # a failed tool: MCP's content parts
        error = "\n".join(part["text"] for part in error["content"])
    assert call.locator(".output").inner_text() == (error or kept["output"])
    if kept["name"] == "add":  # the server really ran it with what the model wrote
        arguments = json.loads(kept["arguments"])
        assert int(kept["output"]) == arguments["a"] + arguments["b"]


def test_the_csp_violation_check_can_fail(browser: Any, url: str) -> None:
    """What the page fixture relies on: an inline script is refused, and the refusal is seen."""
    tab = Tab(browser)
    try:
        page = tab.open(url)
        page.evaluate(
            "() => { const s = document.createElement('script'); s.textContent = 'window.ran = 1';"
            " document.body.append(s); }"
        )
        assert page.evaluate("window.ran") is None
        assert any("CSP violation: script-src" in error for error in tab.errors)
    finally:
        tab.context.close()


def test_audio_files_dictation_and_reading_aloud(tab: Tab, tmp_path: Path) -> None:
    models = {"gemma4": FIXTURES / "tiny-gemma4-mm", "whisper": TINY_WHISPER, "joe": JOE}
    with running(create_app(ServerConfig(models=models, ui=True))) as url:
        page = tab.open(url)
        assert "audio" in page.locator("#model-takes").inner_text()
        sound = tmp_path / "tone.wav"
        sound.write_bytes(tone_wav(0.5))
        page.locator("#attach").set_input_files(str(sound))
        expect(page.locator("#attachments")).to_contain_text("audio (wav)")
        send(page, "what do you hear?", model="gemma4", tokens=4)
        assert "audio (wav)" in page.locator(".message.user").inner_text()
        kept = httpx.get(f"{url}/v1/ui/conversations/{page.evaluate('location.hash.slice(1)')}").json()
        assert kept["messages"][0]["content"][1]["input_audio"]["format"] == "wav"

        # Dictation: the fake microphone, recorded as WAV (the server decodes it or answers
        # 400), through the speech model, into the message box.
        with page.expect_response("**/v1/audio/transcriptions") as heard:
            page.get_by_role("button", name="Dictate").click()
            expect(page.get_by_role("button", name="Stop dictating")).to_be_visible()
            page.wait_for_timeout(500)
            page.get_by_role("button", name="Stop dictating").click()
        assert heard.value.status == 200
        text = heard.value.json()["text"].strip()
        expect(page.get_by_role("button", name="Dictate")).to_be_visible()
        expect(page.get_by_label("Message", exact=True)).to_have_value(text)

        # Reading aloud: the voice model's WAV, played.
        with page.expect_response("**/v1/audio/speech") as spoken:
            page.get_by_role("button", name="Read this reply aloud").click()
        assert spoken.value.status == 200 and spoken.value.headers["content-type"].startswith("audio/wav")
        page.wait_for_timeout(200)
        assert page.get_by_role("status").inner_text() == ""  # play() was not refused


def _cli(*args: str) -> tuple[subprocess.Popen[str], str]:
    process, ready = start_server("--model", f"tiny={TINY_MODEL}", *args)
    return process, f"http://127.0.0.1:{ready['port']}"


def test_a_keyed_server_keeps_each_keys_conversations_across_a_restart(browser: Any, tab: Tab, tmp_path: Path) -> None:
    keyed = ("--api-key", "alice-key", "--api-key", "bob-key", "--admin-key", "root-key", "--state-dir", str(tmp_path))
    process, url = _cli(*keyed)
    try:
        page = tab.open(url, key="alice-key")
        send(page, "alice's question", tokens=4)
        expect(page.locator("#conversations")).to_contain_text("alice's question")
        # Unloading asks for the admin key (the API key is not enough).
        page.get_by_role("button", name="Server").click()
        page.get_by_role("button", name="Unload tiny").click()
        expect(page.get_by_role("heading", name="Admin key")).to_be_visible()
        page.get_by_label("Key", exact=True).fill("root-key")
        page.get_by_role("button", name="Use this key").click()
        expect(page.locator("#models tr[data-model=tiny] td").nth(2)).to_have_text("unloaded")
        page.get_by_role("button", name="Chat").click()  # the server view polls; the server stops below
        bob = Tab(browser)  # another tab: sessionStorage is per tab
        try:
            bob_page = bob.page
            bob_page.goto(url)
            bob_page.keyboard.press("Escape")  # no key given: the page says so, and asks again when told
            expect(bob_page.get_by_role("status")).to_have_text("no api key given")
            bob_page.get_by_role("button", name="API key").click()
            bob_page.get_by_label("Key", exact=True).fill("bob-key")
            with bob_page.expect_response("**/v1/ui/conversations?*") as listed:
                bob_page.get_by_role("button", name="Use this key").click()
            assert listed.value.status == 200 and listed.value.json()["data"] == []
            assert bob_page.locator("#conversations li").count() == 0
            assert bob.errors == []
        finally:
            bob.context.close()
    finally:
        stop(process)

    process, url = _cli(*keyed)
    try:
        page = tab.open(url, key="alice-key")  # a new port: a new origin, the key asked again
        expect(page.locator("#conversations")).to_contain_text("alice's question")
    finally:
        stop(process)
