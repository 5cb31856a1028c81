"""The training script end to end on a toy size: a loadable checkpoint, bit-for-bit reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mm_serve.shapes.model_config import ModelSize
from mm_serve.shapes.train import TrainConfig, train

TOY = ModelSize(
    vision_hidden=32, vision_layers=1, vision_heads=2, text_hidden=32, text_intermediate=64, text_layers=1,
    text_heads=4, text_kv_heads=2,
)
CFG = TrainConfig(vision_steps=2, vision_batch_size=4, steps=2, batch_size=2, qa_steps=1, warmup=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    first, second = tmp_path_factory.mktemp("run1"), tmp_path_factory.mktemp("run2")
    train(first, CFG, TOY)
    train(second, CFG, TOY)
    return first, second


def test_same_seed_same_weights(runs: tuple[Path, Path]) -> None:
    first, second = runs
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()


def test_output_is_a_llava_hf_checkpoint(runs: tuple[Path, Path]) -> None:
    out = runs[0]
    model = LlavaForConditionalGeneration.from_pretrained(out)
    assert model.config.text_config.hidden_size == TOY.text_hidden
    assert AutoProcessor.from_pretrained(out).tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id
    record = (out / "TRAINING.md").read_text()
    assert "--seed 0" in record and "wall time" in record


def test_stage_three_needs_steps(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        train(tmp_path, TrainConfig(qa_steps=0), TOY, start_stage=3)
