"""A decode worker's model: the decoder of a llava checkpoint without its vision tower and projector."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_serve.models.loader import load_model
from mm_serve.models.weights import load_state_dicts
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.worker_setup import load_for_worker
from mm_serve.runtime.worker_spec import WorkerSpec


def test_without_vision_only_the_decoder_is_built_with_the_same_weights_and_outputs(tiny_llava: Path) -> None:
    full = load_model(tiny_llava)
    text = load_model(tiny_llava, vision=False)
    assert full.vision is not None and full.projector is not None
    assert text.vision is None and text.projector is None
    assert text.image_token_index == full.image_token_index is not None  # the config still knows its images
    count = sum(p.numel() for p in text.parameters())
    assert count == sum(p.numel() for p in full.language_model.parameters())
    assert count < sum(p.numel() for p in full.parameters())
    full_state, text_state = full.language_model.state_dict(), text.language_model.state_dict()
    assert full_state.keys() == text_state.keys()
    assert all(torch.equal(full_state[k], text_state[k]) for k in full_state)
    # image rows arrive as embeddings (as a hand-off brings them): the same embeddings in, the same rows out
    ids = torch.tensor([1, 5, full.image_token_index, full.image_token_index, 7])
    rows = torch.randn(2, full.config.text.hidden_size)
    assert torch.equal(full.embed(ids, rows), text.embed(ids, rows))
    size = full.config.vision.image_size  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="built without its vision tower"):
        text.encode_images(torch.zeros(1, 3, size, size))


def test_only_the_asked_parts_are_read(tiny_llava: Path) -> None:
    every, lm = load_state_dicts(tiny_llava), load_state_dicts(tiny_llava, ("lm",))
    assert every["vision"] and every["projector"]  # a llava checkpoint
    assert not lm["vision"] and not lm["projector"]
    assert lm["lm"].keys() == every["lm"].keys()
    assert all(torch.equal(lm["lm"][k], every["lm"][k]) for k in every["lm"])


@pytest.mark.parametrize(("role", "tower"), [("decode", False), ("prefill", True), ("colocated", True)])
def test_only_the_decode_role_loads_without_the_tower(tiny_llava: Path, role: str, tower: bool) -> None:
    spec = WorkerSpec(role=role, index=0, model_dir=str(tiny_llava), sizing=EngineConfig(num_pages=16),
                      control_address="", output_address="")
    _, sizing, model, _ = load_for_worker(spec)
    assert sizing.dtype == "float32"  # auto: the checkpoint's
    assert (model.vision is not None) == tower and (model.projector is not None) == tower
