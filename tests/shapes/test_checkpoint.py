"""The committed embedded checkpoint: a normal llava-hf directory that answers correctly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
    LlavaForConditionalGeneration,
)

from mm_serve.models.named_models import EMBEDDED_MODEL_DIR, resolve_model
from mm_serve.shapes.evaluate import EVAL_NAMESPACE, GenerateFn, hf_generate_fn
from mm_serve.shapes.model_config import IMAGE_SIZE, NUM_IMAGE_TOKENS
from mm_serve.shapes.scenes import draw_scene, scene_rng
from mm_serve.shapes.targets import caption, count_qa

MODEL_DIR = EMBEDDED_MODEL_DIR
MAX_BYTES = 30 * 1024 * 1024


def test_files_config_and_size() -> None:
    assert resolve_model(None) == MODEL_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "preprocessor_config.json", "TRAINING.md"):
        assert (MODEL_DIR / name).is_file(), name
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) <= MAX_BYTES
    config = json.loads((MODEL_DIR / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert config["image_token_index"] == tokenizer.convert_tokens_to_ids("<image>")
    assert config["vision_feature_select_strategy"] == "default"
    assert config["vision_feature_layer"] in (-1, -2)
    assert config["projector_hidden_act"] == "gelu"
    text = config["text_config"]
    assert text["num_key_value_heads"] < text["num_attention_heads"]
    assert text["vocab_size"] == len(tokenizer)
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
        assert {weights.get_slice(k).get_dtype() for k in keys} == {"F32"}
    assert any(k.startswith("multi_modal_projector.linear_1") for k in keys)
    assert any(k.startswith("vision_tower.") for k in keys)
    assert any(k.startswith("language_model.") for k in keys)


def test_processors_load_offline_and_squash() -> None:
    image_processor = AutoImageProcessor.from_pretrained(MODEL_DIR, backend="pil")
    assert not image_processor.do_center_crop
    image, _ = draw_scene(scene_rng("test-checkpoint", 0, 0), size=(300, 100))
    pixels = image_processor(image, return_tensors="pt")["pixel_values"]
    assert tuple(pixels.shape) == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
    processor = AutoProcessor.from_pretrained(MODEL_DIR)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
        add_generation_prompt=True,
    )
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    assert int((inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<image>")).sum()) == NUM_IMAGE_TOKENS


@pytest.fixture(scope="module")
def generate() -> GenerateFn:
    torch.manual_seed(0)
    return hf_generate_fn(MODEL_DIR)


def test_loads_in_transformers() -> None:
    model = LlavaForConditionalGeneration.from_pretrained(MODEL_DIR)
    assert model.config.image_token_id == 4
    assert sum(p.numel() for p in model.parameters()) < 8_000_000


def test_answers_fresh_scenes(generate: GenerateFn) -> None:
    scenes = [draw_scene(scene_rng(f"{EVAL_NAMESPACE}-test", 7, i)) for i in range(5)]
    captions = generate([(image, "Describe the image.") for image, _ in scenes])
    right = sum(got.strip() == caption(objects) for got, (_, objects) in zip(captions, scenes, strict=True))
    assert right >= 4, list(zip(captions, [caption(o) for _, o in scenes], strict=True))
    counts = generate([(image, "How many shapes are there?") for image, _ in scenes])
    assert sum(got.strip() == count_qa(o).answer for got, (_, o) in zip(counts, scenes, strict=True)) >= 4
