"""``/playground`` in headless Chromium against the embedded model behind an API key: the page asks for the
key and works only with the right one; a drawn scene attached and "Describe the image." asked streams the
API's greedy answer into the page, with its TTFT, tokens/s, prompt and cached tokens and tier; a 429 and a
400 show as messages; nothing is fetched from anywhere but the server."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

import httpx

from mm_serve.shapes.scenes import draw_scene
from tests.api.server_process import ServerProcess
from tests.console.conftest import API_KEY, screenshot


def _scene(path: Path) -> bytes:
    """A scene of the embedded model's world (as ``python -m mm_serve.shapes draw --seed 5``), written as PNG."""
    image, _ = draw_scene(random.Random(5))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def _api_answer(server: ServerProcess, png: bytes, question: str, max_tokens: int) -> str:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "messages": [
                       {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": question}]}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _ask(page: Any, question: str) -> Any:
    """Send ``question`` and wait for its reply to end; returns the reply's element."""
    before = page.locator(".message.assistant").count()
    page.fill("#question", question)
    page.click("#send")
    reply = page.locator(".message.assistant").nth(before)
    reply.and_(page.locator("[data-done]")).wait_for(timeout=60_000)
    return reply


def test_the_playground_streams_the_greedy_answer_and_shows_refusals(page: Any, console_server: ServerProcess,
                                                                      tmp_path: Path) -> None:
    page.goto(f"{console_server.url}/playground")
    page.locator("#key-form").wait_for()  # no key yet: the page asks for one, the chat is not shown
    assert page.locator("#app").is_hidden() and "needs an API key" in page.text_content("#key-reason")
    page.fill("#api-key", "wrong")
    page.click("#key-form button")
    page.wait_for_function("document.getElementById('key-reason').textContent.includes('not accepted')")
    assert page.locator("#app").is_hidden()
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.locator("#app").wait_for()

    png = _scene(tmp_path / "scene.png")
    page.set_input_files("#attach", str(tmp_path / "scene.png"))
    page.locator("#thumbs img").wait_for()
    reply = _ask(page, "Describe the image.")
    expected = _api_answer(console_server, png, "Describe the image.", 128)
    assert reply.locator(".text").text_content() == expected and expected.strip()
    stats = {s.get_attribute("data-stat"): s.text_content() for s in reply.locator(".stats span").all()}
    assert stats["TTFT"].endswith(" ms") and stats["tier"] == "tier standard", stats
    assert stats["prompt"].startswith("prompt ") and "cached" in stats and "tokens/s" in stats
    screenshot(page, "playground.png", tmp_path)

    page.click("#new-chat")  # a question over the prefill-queue cap: a 429, read as a message
    busy = _ask(page, "tell me about the shapes " * 40)
    assert busy.get_attribute("data-status") == "429"
    assert "busy" in busy.text_content() and "try again in" in busy.text_content()
    page.fill("#max-tokens", "100000")  # past the context: a 400 with the server's reason
    refused = _ask(page, "Describe the image.")
    assert refused.get_attribute("data-status") == "400" and "context length" in refused.text_content()
    page.fill("#max-tokens", "16")  # the conversation goes on after refusals
    ok = _ask(page, "What is in the picture?")
    assert ok.get_attribute("data-status") is None and ok.locator(".stats").count() == 1
    assert page.outside == [] and all(url.startswith(console_server.url) for url in page.requests), page.requests


def test_images_go_in_the_order_chosen_and_new_chat_drops_a_reply_in_flight(
        page: Any, console_server: ServerProcess, tmp_path: Path) -> None:
    """Two images, the first much larger (read later): the call's image parts keep the order they were chosen
    in. New chat while a reply streams: the next call's messages hold nothing of the old conversation."""
    page.goto(f"{console_server.url}/playground")
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.locator("#app").wait_for()
    big, small = tmp_path / "big.bmp", tmp_path / "small.png"
    image, _ = draw_scene(random.Random(1), size=(512, 512))
    image.save(big, format="BMP")  # uncompressed: ~1 MB, read long after the small one
    _scene(small)
    page.set_input_files("#attach", [str(big), str(small)])
    page.wait_for_function("document.querySelectorAll('#thumbs img').length === 2")
    page.fill("#max-tokens", "200")
    page.fill("#question", "Describe both.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    urls = [part["image_url"]["url"] for part in sent.value.post_data_json["messages"][0]["content"][:2]]
    assert [len(u) for u in urls] == sorted((len(u) for u in urls), reverse=True)  # the big one first
    page.click("#new-chat")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.fill("#question", "A new question.")
        page.click("#send")
    assert sent.value.post_data_json["messages"] == [{"role": "user", "content": "A new question."}]
    page.locator(".message.assistant[data-done]").wait_for(timeout=60_000)
    assert page.locator(".message").count() == 2  # the question and its answer only
