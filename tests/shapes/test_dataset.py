"""Training data: per-patch labels and deterministic, well-formed batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, CLIPImageProcessorPil

from mm_serve.shapes.dataset import (
    IGNORE_INDEX,
    ConversationEncoder,
    TrainingStream,
    VisionStream,
    patch_labels,
    question_probe_class,
    sample_grounded_turns,
    sample_turns,
)
from mm_serve.shapes.model_config import IMAGE_SIZE, NUM_IMAGE_TOKENS, image_processor_config
from mm_serve.shapes.scenes import COLOURS, SceneObject, draw_scene, scene_rng
from mm_serve.shapes.targets import QA
from mm_serve.shapes.tokenizer import save_tokenizer, train_tokenizer


def test_patch_labels_geometry() -> None:
    # a 64 x 64 image, 4 x 4 patches of 16 px: a square filling patch (0, 0), a circle in patch (3, 3)
    square = SceneObject("blue", "square", (0, 0, 16, 16))
    circle = SceneObject("orange", "circle", (48, 48, 64, 64))
    labels = patch_labels([square, circle], (64, 64), grid=4)
    shape, colour, rank = labels
    assert shape.tolist() == [2] + [0] * 14 + [1]
    assert colour[0] == 2 and colour[15] == 5 and (colour[1:15] == IGNORE_INDEX).all()
    assert rank[0] == 0 and rank[15] == 1


def test_triangle_leaves_top_corners_empty() -> None:
    triangle = SceneObject("red", "triangle", (0, 0, 64, 64))
    shape = patch_labels([triangle], (64, 64), grid=8)[0].reshape(8, 8)
    assert shape[0, 0] == 0 and shape[0, 7] == 0 and shape[0, 3] == 3 and (shape[7] == 3).all()


def test_turns_cover_every_kind_once() -> None:
    for index in range(50):
        rng = scene_rng("test-dataset", 0, index)
        _, objects = draw_scene(rng)
        kinds = [qa.kind for qa in sample_turns(objects, rng)]
        assert len(kinds) == len(set(kinds)) and {"caption", "count", "exists"} <= set(kinds)


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> TrainingStream:
    out: Path = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(), out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = {k: v for k, v in image_processor_config().items() if k != "image_processor_type"}
    encoder = ConversationEncoder(tokenizer, tokenizer.convert_tokens_to_ids("<image>"))
    return TrainingStream(encoder, CLIPImageProcessorPil(**config), seed=0, batch_size=4)


def test_training_batches_are_deterministic_and_well_formed(stream: TrainingStream) -> None:
    first, again, other = stream.batch(3), stream.batch(3), stream.batch(4)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["pixel_values"], other["pixel_values"])
    assert first["pixel_values"].shape == (4, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert first["patch_labels"].shape == (4, 3, NUM_IMAGE_TOKENS)
    image_id = stream.encoder.image_token_id
    assert ((first["input_ids"] == image_id).sum(dim=1) == NUM_IMAGE_TOKENS).all()
    supervised = first["labels"] != IGNORE_INDEX
    assert not (supervised & (first["input_ids"] == image_id)).any()
    assert (first["labels"][supervised] == first["input_ids"][supervised]).all()
    assert (first["attention_mask"].bool() | (first["input_ids"] == stream.encoder.tokenizer.pad_token_id)).all()


def test_question_probe_labels_sit_on_the_shape_word(stream: TrainingStream) -> None:
    assert question_probe_class(QA("colour", "What color is the square?", "orange")) == list(COLOURS).index("orange")
    assert question_probe_class(QA("exists", "Is there a red circle?", "no")) == len(COLOURS)
    assert question_probe_class(QA("exists", "Is there a red circle?", "yes")) == len(COLOURS) + 1
    assert question_probe_class(QA("count", "How many shapes are there?", "two")) == IGNORE_INDEX
    rng = scene_rng("train", 0, 5)
    _, objects = draw_scene(rng)
    turns = sample_grounded_turns(objects, rng, caption_first=0.0)
    ids, labels, probes = stream.encoder.encode_with_probes(turns)
    assert (ids, labels) == stream.encoder.encode(turns)
    tokenizer = stream.encoder.tokenizer
    probed = [(tokenizer.decode([ids[i]]).strip(), target) for i, target in enumerate(probes) if target != IGNORE_INDEX]
    expected = [(qa.question.rstrip("?").split()[-1], question_probe_class(qa))
                for qa in turns if qa.kind in ("colour", "exists")]
    assert probed == expected and len(expected) >= 4


def test_vision_batches(stream: TrainingStream) -> None:
    vision = VisionStream(stream.image_processor, grid=8, seed=0, batch_size=3)
    pixels, labels = vision.batch(0)
    assert pixels.shape == (3, 3, IMAGE_SIZE, IMAGE_SIZE) and labels.shape == (3, 3, 64)
    assert torch.equal(labels, vision.batch(0)[1])
    assert (labels[:, 0] > 0).any(dim=1).all()  # every scene has shape-covered patches
