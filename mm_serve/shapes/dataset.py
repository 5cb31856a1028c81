"""Training batches drawn on the fly: scenes, multi-turn conversations, tensors.

One training example is one scene and a conversation about it with one turn per
question kind (3 or 4 turns: ``colour`` needs a shape present once), the image in
the first user turn (the chat template's layout)::

    <s>USER: <image>x64\\n{q1} ASSISTANT: {a1}</s>USER: {q2} ASSISTANT: {a2}</s>...

Loss is on answer tokens and their ``</s>`` only (``labels`` is -100 elsewhere,
the Hugging Face ignore index). Several turns per image amortise the vision tower
and the image tokens over more supervised tokens. Attention is causal, so the first
turn is trained exactly as a single-turn request looks when served; its kind is
drawn with :data:`FIRST_TURN_WEIGHTS` (captions are the hardest task).

Batch ``step`` of a run with seed ``seed`` depends only on ``(seed, step)``:
scene ``i`` of it comes from ``scene_rng(namespace, seed, step * batch_size + i)``,
namespace ``train`` (stage 2, :func:`sample_turns`) or ``train-qa`` (stage 3,
:func:`sample_grounded_turns`: questions that need the image, before the caption).

The vision warm-up stage (:class:`VisionStream`, namespace ``train-vision``) labels
every patch of the squashed image with the shape covering it (:func:`patch_labels`):
its shape, its colour and its rank from the left.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase
from transformers.image_processing_utils import BaseImageProcessor

from mm_serve.shapes.model_config import NUM_IMAGE_TOKENS
from mm_serve.shapes.scenes import COLOURS, SHAPES, SceneObject, draw_scene, scene_rng
from mm_serve.shapes.targets import (
    CAPTION_PROMPTS,
    QA,
    QAKind,
    caption_qa,
    colour_questions,
    count_qa,
    exists_qa,
    sample_qa,
)
from mm_serve.shapes.tokenizer import IMAGE

TRAIN_NAMESPACE = "train"
VISION_NAMESPACE = "train-vision"
_SUBSAMPLES = 4  # points per patch side when measuring which shape covers a patch
IGNORE_INDEX = -100
QA_NAMESPACE = "train-qa"
FIRST_TURN_WEIGHTS: dict[QAKind, float] = {"caption": 0.4, "count": 0.2, "colour": 0.2, "exists": 0.2}
GROUNDED_EXISTS = 4  # yes/no questions per stage 3 conversation
GROUNDED_CAPTION_FIRST = 0.2  # probability that a stage 3 conversation starts with the caption


def user_prompt(question: str, with_image: bool) -> str:
    """One rendered user turn plus the generation prompt, exactly as the chat template writes it."""
    image = f"{IMAGE}\n" if with_image else ""
    return f"USER: {image}{question} ASSISTANT:"


def sample_turns(objects: Sequence[SceneObject], rng: random.Random) -> list[QA]:
    """Stage 2: one question per kind in random order, the first kind drawn with :data:`FIRST_TURN_WEIGHTS`."""
    kinds: list[QAKind] = list(FIRST_TURN_WEIGHTS)
    first = rng.choices(kinds, weights=list(FIRST_TURN_WEIGHTS.values()))[0]
    order = [first] + rng.sample([k for k in kinds if k != first], len(kinds) - 1)
    return [qa for qa in (sample_qa(objects, rng, kind) for kind in order) if qa is not None]


def sample_grounded_turns(
    objects: Sequence[SceneObject], rng: random.Random, caption_first: float = GROUNDED_CAPTION_FIRST
) -> list[QA]:
    """Many questions that need the image, asked before the caption.

    :data:`GROUNDED_EXISTS` distinct yes/no questions, the colour of every shape present once
    and the count, shuffled; the caption comes last (first with probability
    ``caption_first``), so most answers cannot be copied from a caption already in
    the context and the model must read them off the image.
    """
    questions: list[QA] = []
    for _ in range(4 * GROUNDED_EXISTS):  # distinct yes/no questions (a repeat could be copied)
        qa = exists_qa(objects, rng)
        if qa not in questions:
            questions.append(qa)
        if len(questions) == GROUNDED_EXISTS:
            break
    questions += [*colour_questions(objects), count_qa(objects)]
    rng.shuffle(questions)
    described = caption_qa(objects, rng.choice(CAPTION_PROMPTS))
    return [described, *questions] if rng.random() < caption_first else [*questions, described]


QUESTION_PROBE_CLASSES = len(COLOURS) + 2  # a colour, or "no" / "yes"


def question_probe_class(qa: QA) -> int:
    """Target of the question probe (training only): the answer colour's index in ``COLOURS``
    for a colour question, ``len(COLOURS)`` for "no" and ``+ 1`` for "yes"; -100 otherwise."""
    if qa.kind == "colour":
        return list(COLOURS).index(qa.answer)
    if qa.kind == "exists":
        return len(COLOURS) + (qa.answer == "yes")
    return IGNORE_INDEX


class ConversationEncoder:
    """Token ids and labels of conversations; caches the few distinct prompt and answer strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self._cache: dict[str, list[int]] = {}

    def _ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._cache[text]

    def encode(self, turns: Sequence[QA]) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one conversation, ``<image>`` expanded to the patch count."""
        input_ids, labels, _ = self.encode_with_probes(turns)
        return input_ids, labels

    def encode_with_probes(self, turns: Sequence[QA]) -> tuple[list[int], list[int], list[int]]:
        """:meth:`encode` plus ``probe_labels``: per position, the :func:`question_probe_class` of
        a colour or yes/no question at its last word (the shape), -100 elsewhere."""
        input_ids = [self.tokenizer.bos_token_id]
        labels = [IGNORE_INDEX]
        probes = [IGNORE_INDEX]
        for index, qa in enumerate(turns):
            prompt = self._ids(user_prompt(qa.question, with_image=index == 0))
            answer = self._ids(f" {qa.answer}{self.tokenizer.eos_token}")
            target = question_probe_class(qa)
            # the prompt ends "... <shape>? ASSISTANT:"; the shape word sits 4 tokens from its end
            word = len(prompt) - 4
            if target != IGNORE_INDEX and self._ids(" " + qa.question.rstrip("?").split()[-1]) != [prompt[word]]:
                target = IGNORE_INDEX  # the tokenizer split the word: no probe on this turn
            for position, token in enumerate(prompt):
                count = NUM_IMAGE_TOKENS if token == self.image_token_id else 1
                input_ids += [token] * count
                labels += [IGNORE_INDEX] * count
                probes += [target if position == word else IGNORE_INDEX] * count
            input_ids += answer
            labels += answer
            probes += [IGNORE_INDEX] * len(answer)
        return input_ids, labels, probes


class TrainingStream:
    """Deterministic batches for step ``0, 1, ...`` of a training run."""

    def __init__(
        self,
        encoder: ConversationEncoder,
        image_processor: BaseImageProcessor,
        seed: int,
        batch_size: int,
        namespace: str = TRAIN_NAMESPACE,
        grounded: bool = False,
        caption_first: float = GROUNDED_CAPTION_FIRST,
    ) -> None:
        self.encoder = encoder
        self.image_processor = image_processor
        self.seed = seed
        self.batch_size = batch_size
        self.namespace = namespace
        self.grounded = grounded
        self.caption_first = caption_first

    def examples(self, step: int) -> list[tuple[Image.Image, list[SceneObject], list[QA]]]:
        """The ``batch_size`` (image, shapes, turns) triples of batch ``step``."""
        result = []
        for i in range(self.batch_size):
            rng = scene_rng(self.namespace, self.seed, step * self.batch_size + i)
            image, objects = draw_scene(rng)
            turns = sample_grounded_turns(objects, rng, self.caption_first) if self.grounded else sample_turns(objects, rng)
            result.append((image, objects, turns))
        return result

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """Tensors of batch ``step``: ``input_ids``, ``attention_mask``, ``labels`` ``[B, T]``
        (right-padded with ``<pad>``), ``pixel_values`` ``[B, 3, S, S]`` float32,
        ``patch_labels`` ``[B, 3, grid * grid]`` (:func:`patch_labels`, for the auxiliary loss)
        and ``probe_labels`` ``[B, T]`` (:meth:`ConversationEncoder.encode_with_probes`)."""
        examples = self.examples(step)
        encoded = [self.encoder.encode_with_probes(turns) for _, _, turns in examples]
        length = max(len(ids) for ids, _, _ in encoded)
        pad = self.encoder.tokenizer.pad_token_id
        input_ids = torch.full((len(encoded), length), pad, dtype=torch.long)
        labels = torch.full((len(encoded), length), IGNORE_INDEX, dtype=torch.long)
        probes = torch.full((len(encoded), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
        for row, (ids, labs, probe) in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(labs)] = torch.tensor(labs)
            probes[row, : len(probe)] = torch.tensor(probe)
            attention_mask[row, : len(ids)] = 1
        pixels = self.image_processor([image for image, _, _ in examples], return_tensors="pt")
        grid = math.isqrt(NUM_IMAGE_TOKENS)
        patches = [patch_labels(objects, image.size, grid) for image, objects, _ in examples]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "pixel_values": pixels["pixel_values"],
            "patch_labels": torch.from_numpy(np.stack(patches)),
            "probe_labels": probes,
        }


def _inside(obj: SceneObject, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Boolean mask of the points ``(xs, ys)`` (px) that fall inside the drawn shape."""
    x0, y0, x1, y1 = obj.bbox
    half = (x1 - x0) / 2
    cx, cy = x0 + half, y0 + half
    if obj.shape == "circle":
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= half**2
    in_box = (xs >= x0) & (xs < x1) & (ys >= y0) & (ys < y1)
    if obj.shape == "square":
        return in_box
    return in_box & (np.abs(xs - cx) <= (ys - y0) / (y1 - y0) * half)


def patch_labels(objects: Sequence[SceneObject], size: tuple[int, int], grid: int) -> np.ndarray:
    """``[3, grid * grid]`` int64 labels of the patches (row-major) of the image squashed to a square.

    Rows: shape (0 background, 1 + index in ``SHAPES``), colour (index in ``COLOURS``,
    -100 on background) and rank from the left (-100 on background). A patch belongs
    to the shape covering most of its sample points, if any covers one.
    """
    width, height = size
    offsets = (np.arange(grid * _SUBSAMPLES) + 0.5) / (grid * _SUBSAMPLES)
    ys, xs = np.meshgrid(offsets * height, offsets * width, indexing="ij")
    cover = np.stack([_inside(obj, xs, ys) for obj in objects])  # [n, G*s, G*s]
    cover = cover.reshape(len(objects), grid, _SUBSAMPLES, grid, _SUBSAMPLES).sum(axis=(2, 4)).reshape(len(objects), -1)
    owner = cover.argmax(axis=0)
    covered = cover.max(axis=0) > 0
    colour_ids = list(COLOURS)
    labels = np.full((3, grid * grid), IGNORE_INDEX, dtype=np.int64)
    labels[0] = np.where(covered, 1 + np.array([SHAPES.index(o.shape) for o in objects])[owner], 0)
    labels[1] = np.where(covered, np.array([colour_ids.index(o.colour) for o in objects])[owner], IGNORE_INDEX)
    labels[2] = np.where(covered, owner, IGNORE_INDEX)
    return labels


class VisionStream:
    """Deterministic batches for the vision warm-up: pixels and per-patch labels."""

    def __init__(self, image_processor: BaseImageProcessor, grid: int, seed: int, batch_size: int) -> None:
        self.image_processor = image_processor
        self.grid = grid
        self.seed = seed
        self.batch_size = batch_size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values`` ``[B, 3, S, S]`` and labels ``[B, 3, grid * grid]`` (see :func:`patch_labels`)."""
        images, labels = [], []
        for i in range(self.batch_size):
            image, objects = draw_scene(scene_rng(VISION_NAMESPACE, self.seed, step * self.batch_size + i))
            images.append(image)
            labels.append(patch_labels(objects, image.size, self.grid))
        pixels = self.image_processor(images, return_tensors="pt")["pixel_values"]
        return pixels, torch.from_numpy(np.stack(labels))
