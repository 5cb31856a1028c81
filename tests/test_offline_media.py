"""The offline API's image forms: every accepted form gives the same model inputs; bad ones a clear error."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from mm_serve.inputs.input_processor import InputProcessor, InvalidRequestError
from mm_serve.media.offline import normalize_messages, to_pil
from mm_serve.models.registry import load_model_config


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


IMAGE = Image.new("RGB", (40, 30), (200, 30, 30))
IMAGE.putpixel((3, 4), (0, 0, 255))


def test_every_form_decodes_to_the_same_pixels(tmp_path: Path) -> None:
    data = _png(IMAGE)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    for form in (IMAGE, data, path, str(path), f"file://{path}", uri):
        assert to_pil(form).convert("RGB").tobytes() == IMAGE.tobytes(), type(form)


@pytest.mark.parametrize("value, message", [
    ("https://example.com/a.png", "does not fetch"),
    ("/nonexistent/a.png", "cannot read"),
    (b"not an image", "image:"),
    ("data:text/plain;base64,aGk=", "media type"),
    (42, "not int"),
])
def test_bad_images_raise_value_errors(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_pil(value)


def test_a_lazily_opened_truncated_file_and_an_empty_image_raise_value_errors(tmp_path: Path) -> None:
    """``Image.open`` reads a header only: a file cut short fails when decoded, which the offline API does
    up front (a ValueError, not Pillow's OSError from inside the processor); a 0 x 0 image is refused as
    the server refuses it."""
    big = Image.effect_noise((200, 200), 64).convert("RGB")
    data = _png(big)
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="image: the PIL image cannot be decoded"):
        to_pil(Image.open(tmp_path / "cut.png"))
    with pytest.raises(ValueError, match=r"image: the PIL image is empty \(0x0 px\)"):
        to_pil(Image.new("RGB", (0, 0)))
    whole = Image.open(io.BytesIO(data))
    assert to_pil(whole).tobytes() == big.tobytes()


def test_normalize_rejects_unknown_parts_and_malformed_messages() -> None:
    with pytest.raises(ValueError, match="unsupported content part type 'audio'"):
        normalize_messages([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])
    with pytest.raises(ValueError, match="video: cannot read 'x'"):
        normalize_messages([{"role": "user", "content": [{"type": "video", "video": "x"}]}])
    with pytest.raises(ValueError, match="videos are accepted only in user messages"):
        normalize_messages([{"role": "assistant", "content": [{"type": "video", "video": "x"}]}])
    with pytest.raises(ValueError, match="non-empty list"):
        normalize_messages([])
    with pytest.raises(ValueError, match="'role'"):
        normalize_messages(["hello"])
    with pytest.raises(ValueError, match="message 0: role 'wizard' is not one of system, developer, user, "
                                         "assistant, tool"):  # as the server's schema
        normalize_messages([{"role": "wizard", "content": "x"}])
    messages, images = normalize_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": "hi"}]}])
    assert images == [IMAGE] and messages[0]["content"][0] == {"type": "image", "image": IMAGE}


def test_image_url_parts_reach_the_model_like_image_parts(tiny_llava: Path) -> None:
    processor = InputProcessor(tiny_llava, load_model_config(tiny_llava))
    uri = "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()
    question = {"type": "text", "text": "What is this?"}
    reference = processor.process({"messages": [{"role": "user", "content": [{"type": "image", "image": IMAGE}, question]}]})
    for part in ({"type": "image_url", "image_url": {"url": uri}}, {"type": "image_url", "image_url": uri}):
        got = processor.process({"messages": [{"role": "user", "content": [part, question]}]})
        assert got.prompt_token_ids == reference.prompt_token_ids and got.num_images == 1
        assert reference.pixel_values is not None and got.pixel_values is not None
        assert torch.equal(got.pixel_values, reference.pixel_values)
    with pytest.raises(InvalidRequestError, match="image:"):
        processor.process({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, question]}]})
    with pytest.raises(InvalidRequestError, match="must be a dict"):
        processor.process("hello")  # type: ignore[arg-type]
