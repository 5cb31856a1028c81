"""Video over the HTTP API on a Qwen2.5-VL checkpoint (a real server): ``video_url`` parts (a data URI and
an allowed ``file://`` URL) served with the offline engine's text and prompt tokens, sampled at the
request's ``mm_processor_kwargs.fps``; every bad video a 400 in OpenAI's error format (not a video, a still
image, truncated, too long, more frames than the server samples, too many videos, an unreachable URL, a
private address, a path outside the media folder) while the server keeps serving; a video row through
the Batch API and a video file through the caption job (via the server and in-process)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from mm_serve import LLM, SamplingParams
from mm_serve.media.video_loading import encode_video
from tests.api.server_process import ServerProcess, data_uri
from tests.batch.helpers import jsonl, output_rows, row, upload, wait_final
from tests.factories import build_checkpoint, gradient_image, gradient_video

MAX_TOKENS = 8
MAX_SECONDS = 4  # the server's api.max_video_seconds
CLIP = encode_video(gradient_video(8, 56, 84, 3).frames, fps=4)  # 2 s
LONG = encode_video(gradient_video(12, 56, 56, 4).frames, fps=2)  # 6 s: over MAX_SECONDS


def _uri(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, Path]]:
    """(checkpoint, server URL, the allowed media folder holding ``clip.mp4``)."""
    root = tmp_path_factory.mktemp("api-video")
    model_dir = build_checkpoint("qwen2.5-vl", root / "model")
    media = root / "media"
    media.mkdir()
    (media / "clip.mp4").write_bytes(CLIP)
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "batch": {"data_dir": str(root / "data")},
        "api": {"max_video_seconds": MAX_SECONDS, "allowed_local_media_path": str(media)}}))
    proc = ServerProcess(model_dir, "--config", str(config), log_dir=root)
    try:
        proc.wait_ready()
        yield model_dir, proc.url, media
    finally:
        proc.stop()


def _messages(url: str, text: str = "What happens in this video?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def _post(url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra})


def test_a_video_is_served_as_the_offline_engine_serves_it(server: tuple[Path, str, Path]) -> None:
    """A data URI and the same clip as an allowed file:// URL: the offline engine's text and prompt tokens;
    a higher fps samples more frames, so more prompt tokens (and the text stays the offline engine's)."""
    model_dir, url, media = server
    llm = LLM(model=model_dir, mode="colocated", num_pages=256, page_size=16)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    offline = llm.generate({"messages": _messages(CLIP)}, greedy)[0]  # type: ignore[arg-type]
    for video in (_uri(CLIP), f"file://{media / 'clip.mp4'}"):
        r = _post(url, _messages(video))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == offline.num_prompt_tokens
        assert r.json()["choices"][0]["message"]["content"] == offline.text
    fast = _post(url, _messages(_uri(CLIP)), mm_processor_kwargs={"fps": 4})
    assert fast.status_code == 200, fast.text
    offline_fast = llm.generate({"messages": _messages(CLIP), "mm_processor_kwargs": {"fps": 4}}, greedy)[0]  # type: ignore[arg-type]
    assert fast.json()["usage"]["prompt_tokens"] == offline_fast.num_prompt_tokens > offline.num_prompt_tokens
    assert fast.json()["choices"][0]["message"]["content"] == offline_fast.text


@pytest.mark.parametrize("case", [
    "not-a-video", "still-image", "one-frame-gif", "truncated", "too-long", "too-many-frames", "fps-zero",
    "fps-string", "two-videos", "unreachable", "private-address", "outside-media", "no-url", "assistant-video",
])
def test_bad_video_input_is_a_400_and_the_server_keeps_serving(server: tuple[Path, str, Path], case: str) -> None:
    _, url, _ = server
    png = data_uri(gradient_image(40, 40)).split(",", 1)[1]
    gif = data_uri(gradient_image(40, 40), "GIF").split(",", 1)[1]
    extra: dict[str, Any] = {}
    messages = {
        "not-a-video": _messages(_uri(b"definitely not a video" * 40)),
        "still-image": _messages(f"data:video/mp4;base64,{png}"),
        "one-frame-gif": _messages(f"data:video/gif;base64,{gif}"),
        "truncated": _messages(_uri(CLIP[: len(CLIP) // 3])),
        "too-long": _messages(_uri(LONG)),
        "too-many-frames": _messages(_uri(CLIP)),
        "fps-zero": _messages(_uri(CLIP)),
        "fps-string": _messages(_uri(CLIP)),
        "two-videos": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": _uri(CLIP)}}] * 2}],
        "unreachable": _messages("http://video-host.invalid/clip.mp4"),
        "private-address": _messages("http://10.1.2.3/clip.mp4"),
        "outside-media": _messages("file:///etc/passwd"),
        "no-url": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}],
        "assistant-video": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": [{"type": "video_url", "video_url": {"url": _uri(CLIP)}}]}],
    }[case]
    if case == "too-many-frames":
        extra = {"mm_processor_kwargs": {"max_frames": 1000}}  # the server samples at most 32
    elif case == "fps-zero":
        extra = {"mm_processor_kwargs": {"fps": 0}}
    elif case == "fps-string":
        extra = {"mm_processor_kwargs": {"fps": "2"}}
    r = _post(url, messages, **extra)
    assert r.status_code == 400, (case, r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    expected = {"not-a-video": "not a readable video", "still-image": "still image", "one-frame-gif": "still image",
                "too-long": "longer than",
                "too-many-frames": "max_frames", "two-videos": "videos in one request", "private-address":
                "non-public address", "outside-media": "outside the allowed media", "assistant-video": "user messages"}
    if case in expected:
        assert expected[case] in error["message"], error
    if case in ("too-many-frames", "fps-zero", "fps-string"):
        assert error["param"].startswith("mm_processor_kwargs"), error
    ok = _post(url, _messages(_uri(CLIP)))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_burst_of_small_videos_is_served(server: tuple[Path, str, Path]) -> None:
    """20 small clips at once on an idle server: each reserves its bytes, its packet walk and then what its
    few frames hold (not a worst-case video's), so all fit the image budget and are answered 200."""
    import asyncio

    _, url, _ = server

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [{"model": "tiny", "messages": _messages(_uri(CLIP)), "max_tokens": 2} for _ in range(20)]
            answers = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=b) for b in bodies))
            return [a.status_code for a in answers]

    assert asyncio.run(burst()) == [200] * 20


def test_a_video_row_through_the_batch_api_and_a_video_file_through_the_caption_job(
        server: tuple[Path, str, Path], tmp_path: Path) -> None:
    """A Batch API row with a video: the chat route's text and tokens. A folder of an image and a video
    captioned through the server: one row each, the video's caption the chat route's."""
    model_dir, url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    body = {"model": "tiny", "messages": _messages(_uri(CLIP)), "max_tokens": MAX_TOKENS, "temperature": 0}
    batch = wait_final(client, client.batches.create(input_file_id=upload(client, jsonl([row("v0", body)])),
                                                     endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    (out,) = output_rows(client, batch.output_file_id)
    chat = _post(url, body["messages"], ignore_eos=False).json()
    assert out["response"]["body"]["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    assert out["response"]["body"]["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]

    folder = tmp_path / "inputs"
    folder.mkdir()
    (folder / "clip.mp4").write_bytes(CLIP)
    gradient_image(80, 60, 2).save(folder / "still.png")
    captions_file = tmp_path / "captions.jsonl"
    done = subprocess.run([sys.executable, "-m", "mm_serve.cli.main", "caption", str(folder), "--out",
                           str(captions_file), "--server", url, "--max-tokens", str(MAX_TOKENS), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    captions = {r["id"]: r for r in map(json.loads, captions_file.read_text().splitlines())}
    assert set(captions) == {"clip.mp4", "still.png"} and all(r.get("caption") for r in captions.values())
    chat = _post(url, _messages(_uri(CLIP), "Describe the image."), ignore_eos=False).json()
    assert captions["clip.mp4"]["caption"] == chat["choices"][0]["message"]["content"].strip()
    assert captions["clip.mp4"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    # the in-process engine (no server) samples the video as the server does: the same rows
    engine_file = tmp_path / "engine-captions.jsonl"
    done = subprocess.run([sys.executable, "-m", "mm_serve.cli.main", "caption", str(folder), "--out", str(engine_file),
                           "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    engine = {r["id"]: r for r in map(json.loads, engine_file.read_text().splitlines())}
    for name in ("clip.mp4", "still.png"):
        assert (engine[name]["caption"], engine[name]["prompt_tokens"]) == (
            captions[name]["caption"], captions[name]["prompt_tokens"])
