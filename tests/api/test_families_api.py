"""The chat API on every family's checkpoint (a real server each): an image with OpenAI's ``detail``
``low``, ``high`` and ``auto``, ``usage.prompt_tokens`` equal to what transformers' own processor
counts for the same rendered prompt, the text equal to the offline engine's; the Batch API and the
caption job."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from mm_serve import LLM, SamplingParams
from tests.api.server_process import ServerProcess, data_uri
from tests.batch.helpers import jsonl, output_rows, row, upload, wait_final, write_config
from tests.factories import build_checkpoint, gradient_image

KINDS = ["llava-siglip", "llava-next", "llava-onevision", "fast-vlm", "qwen2-vl"]
IMAGE = gradient_image(200, 120, 7)  # wider than tall: tiles (and is pooled) where a family tiles
MAX_TOKENS = 8
# a tiled image's whole-image tile and its newline (56 px, 14 px patches): what ``low`` leaves
LOW_TOKENS = {"llava-next": 16 + 1, "llava-onevision": 16 + 1}


@pytest.fixture(scope="module", params=KINDS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """(kind, checkpoint, server URL): a server with the Batch API on a temporary data directory."""
    root = tmp_path_factory.mktemp(f"api-{request.param}")
    model_dir = build_checkpoint(request.param, root / "model")
    proc = ServerProcess(model_dir, "--config", str(write_config(root / "config.yaml", root / "data")), log_dir=root)
    try:
        proc.wait_ready()
        yield request.param, model_dir, proc.url
    finally:
        proc.stop()


def _messages(detail: str | None, image: Image.Image = IMAGE) -> list[dict[str, Any]]:
    url: dict[str, Any] = {"url": data_uri(image), **({"detail": detail} if detail else {})}
    return [{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def _transformers_count(kind: str, model_dir: Path, llm: LLM) -> int:
    """The prompt tokens transformers' processor of the family makes from our rendered chat prompt."""
    import transformers

    assert llm.engine is not None
    tokenizer = llm.engine.inputs.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}],
        tokenize=False, add_generation_prompt=True)
    if kind == "llava-onevision":
        processor = transformers.LlavaOnevisionProcessor(
            image_processor=transformers.LlavaOnevisionImageProcessorPil.from_pretrained(str(model_dir)),
            video_processor=transformers.LlavaOnevisionVideoProcessor(), tokenizer=tokenizer, num_image_tokens=16,
            vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_4", image_token="<image>")
        images: Any = [[IMAGE]]
    elif kind == "qwen2-vl":
        processor = transformers.Qwen2VLProcessor(
            image_processor=transformers.Qwen2VLImageProcessorPil.from_pretrained(str(model_dir)),
            video_processor=transformers.Qwen2VLVideoProcessor(), tokenizer=tokenizer)
        images = [IMAGE]
    else:
        image_processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        processor = transformers.AutoProcessor.from_pretrained(str(model_dir), image_processor=image_processor)
        images = [IMAGE]
    return len(processor(text=text, images=images, return_tensors="pt")["input_ids"][0])


def _chat(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_with_each_detail_counts_the_tokens_transformers_counts(family: tuple[str, Path, str]) -> None:
    kind, model_dir, url = family
    llm = LLM(model=model_dir, mode="colocated", num_pages=128, page_size=16)
    full = _transformers_count(kind, model_dir, llm)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for detail in ("high", "auto", None, "low"):
        body = _chat(url, _messages(detail))
        offline = llm.generate({"messages": _messages(detail)}, greedy)[0]
        prompt_tokens = body["usage"]["prompt_tokens"]
        assert prompt_tokens == offline.num_prompt_tokens and body["usage"]["completion_tokens"] == MAX_TOKENS
        assert body["choices"][0]["message"]["content"] == offline.text, detail
        if detail == "low" and kind in LOW_TOKENS:  # the whole-image tile alone: fewer tokens
            assert prompt_tokens == full - (llm.engine.inputs.process({"messages": _messages("high")})  # type: ignore[union-attr]
                                            .image_token_counts[0]) + LOW_TOKENS[kind]
            assert prompt_tokens < full
        else:  # high, auto, absent; and low on a family that does not tile
            assert prompt_tokens == full, (detail, prompt_tokens, full)
    bad = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"model": "tiny", "messages": _messages("max")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.content.0.image_url.detail"


def test_each_family_serves_the_batch_api_and_the_caption_job(family: tuple[str, Path, str], tmp_path: Path) -> None:
    """Two rows through the Batch API (the same text as the chat route) and three images of different
    shapes captioned through the server (one row each, the same captions as the chat route; a tiling
    family counts each shape's own tokens)."""
    kind, _, url = family
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    bodies = [{"model": "tiny", "messages": _messages(d), "max_tokens": MAX_TOKENS, "temperature": 0} for d in ("high", "low")]
    file_id = upload(client, jsonl([row(f"r{i}", b) for i, b in enumerate(bodies)]))
    batch = wait_final(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                     completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    rows = {r["custom_id"]: r["response"]["body"] for r in output_rows(client, batch.output_file_id)}
    for i, body in enumerate(bodies):
        chat = _chat(url, body["messages"])
        assert rows[f"r{i}"]["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
        assert rows[f"r{i}"]["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]

    folder = tmp_path / "images"
    folder.mkdir()
    shapes = {"wide.png": (300, 40), "tall.png": (30, 200), "square.png": (80, 80)}
    for name, (w, h) in shapes.items():
        gradient_image(w, h, len(name)).save(folder / name)
    out = tmp_path / "captions.jsonl"
    done = subprocess.run([sys.executable, "-m", "mm_serve.cli.main", "caption", str(folder), "--out", str(out),
                           "--server", url, "--max-tokens", str(MAX_TOKENS), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    captions = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(captions) == set(shapes)
    counts = set()
    for name in shapes:
        image = Image.open(folder / name)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}},
                                                 {"type": "text", "text": "Describe the image."}]}]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert captions[name]["caption"] == r.json()["choices"][0]["message"]["content"].strip()  # the job strips
        assert captions[name]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
        counts.add(captions[name]["prompt_tokens"])
    # a tiling or dynamic-resolution family: each shape its own token count
    assert len(counts) == (3 if kind in LOW_TOKENS or kind == "qwen2-vl" else 1)


def test_mm_processor_kwargs_over_http(family: tuple[str, Path, str]) -> None:
    """vLLM's ``mm_processor_kwargs`` on a chat call: on Qwen2-VL narrower pixel bounds make fewer image
    tokens (the text equal to the offline engine's under them); bounds outside the checkpoint's, an
    unknown key, min over max, a zero fps, or any bounds (or video sampling) on a family whose images are not
    resized to them: a 400 in OpenAI's format naming the field, and the server keeps serving."""
    kind, model_dir, url = family
    small = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 8}
    bad_cases = [{"max_pixels": 10**9}, {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 4}, {"fps": 0},
                 {"num_frames": 4}]
    if kind == "qwen2-vl":
        body = _chat_with(url, small)
        assert body.status_code == 200, body.text
        llm = LLM(model=model_dir, mode="colocated", num_pages=128, page_size=16)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        offline = llm.generate({"messages": _messages(None), "mm_processor_kwargs": small}, greedy)[0]
        assert body.json()["usage"]["prompt_tokens"] == offline.num_prompt_tokens
        assert body.json()["usage"]["prompt_tokens"] < _chat(url, _messages(None))["usage"]["prompt_tokens"]
        assert body.json()["choices"][0]["message"]["content"] == offline.text
    else:  # pixel bounds and video sampling on a family that takes neither
        bad_cases += [small, {"fps": 1}]
    sliver = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(gradient_image(1, 3000))}},
                                           {"type": "text", "text": "What is this?"}]}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={"model": "tiny", "messages": sliver, "max_tokens": 2})
    assert r.status_code in (200, 400), r.text  # 1 x 3000 px: served, or refused by the family's processor
    if kind == "qwen2-vl":  # its processor refuses an aspect ratio over 200
        assert r.status_code == 400 and "cannot be preprocessed" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "invalid_image"
    if kind != "qwen2-vl":  # a video to a family that takes none: refused before it is fetched
        video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://video.invalid/a.mp4"}}]}]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": "tiny", "messages": video})
        assert r.status_code == 400 and "does not take video" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "invalid_video"
    for kwargs in bad_cases:
        r = _chat_with(url, kwargs)
        assert r.status_code == 400, (kwargs, r.text)
        assert r.json()["error"]["param"].startswith("mm_processor_kwargs"), r.json()
    assert _chat(url, _messages(None))["usage"]["completion_tokens"] == MAX_TOKENS


def _chat_with(url: str, mm_processor_kwargs: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": _messages(None), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "mm_processor_kwargs": mm_processor_kwargs})
