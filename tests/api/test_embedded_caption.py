"""The embedded default model really sees: `Describe the image.` through the API returns the caption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mm_serve.models.named_models import EMBEDDED_MODEL_DIR
from mm_serve.shapes.scenes import draw_scene, scene_rng
from mm_serve.shapes.targets import caption
from tests.api.server_process import ServerProcess, data_uri


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not (EMBEDDED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the embedded checkpoint is not in this checkout")
    proc = ServerProcess(Path(EMBEDDED_MODEL_DIR), log_dir=tmp_path_factory.mktemp("embedded-logs"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_describe_the_image_returns_the_drawn_caption(embedded_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{embedded_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    right = 0
    for index in range(6):
        image, objects = draw_scene(scene_rng("api-test", 2026, index))
        reply = client.chat.completions.create(model="tiny", max_tokens=24, temperature=0, messages=[{
            "role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_uri(image)}},
                {"type": "text", "text": "Describe the image."},
            ]}])
        right += reply.choices[0].message.content.strip() == caption(objects)
        assert reply.choices[0].finish_reason == "stop"
    assert right >= 5, f"{right}/6 captions right (the eval reports 97.8 % exact match)"
