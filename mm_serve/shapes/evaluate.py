"""Score a checkpoint on held-out scenes: caption exact-match, attributes, QA.

Scenes come from ``scene_rng("heldout", seed, i)``, a namespace the trainer never
draws from, so no evaluation scene was seen in training. Per scene:

* the caption prompt ``Describe the image.``: exact match, plus per-attribute
  accuracy from parsing the generated caption: colour (shape) accuracy is the
  fraction of ground-truth shapes whose colour (shape name) is right at the right
  left-to-right position; count accuracy is the fraction of captions that list
  the right number of shapes; a malformed caption scores zero on all three;
* one question of each QA kind (count, colour when a shape is present exactly
  once, exists with yes/no at 50 %); QA accuracy is exact match over all of them.

Answers come from a :data:`GenerateFn` so the same scoring runs on transformers'
``generate`` (:func:`hf_generate_fn`) or on mm-serve's own engine
(:func:`mm_serve_generate_fn`); both send the chat-template prompt
``USER: <image>\n{question} ASSISTANT:`` and decode greedily.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm
from transformers import (
    AutoTokenizer,
    CLIPImageProcessorPil,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from mm_serve.shapes.dataset import user_prompt
from mm_serve.shapes.model_config import PATCH_SIZE
from mm_serve.shapes.scenes import SceneObject, draw_scene, scene_rng
from mm_serve.shapes.targets import QA, caption_qa, parse_caption, sample_qa

EVAL_NAMESPACE = "heldout"
GenerateFn = Callable[[Sequence[tuple[Image.Image, str]]], list[str]]
"""``[(image, question), ...] -> [answer, ...]``: greedy, one answer per question, stripped."""


@dataclass(frozen=True)
class EvalScene:
    """One held-out scene with its caption question and its QA questions."""

    image: Image.Image
    objects: list[SceneObject]
    questions: list[QA]  # the caption question first, then one per QA kind


@dataclass
class EvalReport:
    """Accuracies in [0, 1] over ``n`` scenes; ``qa_by_kind`` maps a kind to (right, asked)."""

    n: int
    caption_exact: float
    colour: float
    shape: float
    count: float
    qa: float
    qa_by_kind: dict[str, tuple[int, int]] = field(default_factory=dict)

    def format(self) -> str:
        """A human-readable multi-line summary (percentages)."""
        lines = [
            f"held-out scenes:       {self.n}",
            f"caption exact-match:   {100 * self.caption_exact:.1f} %",
            f"colour accuracy:       {100 * self.colour:.1f} %",
            f"shape accuracy:        {100 * self.shape:.1f} %",
            f"count accuracy:        {100 * self.count:.1f} %",
            f"QA accuracy:           {100 * self.qa:.1f} %",
        ]
        for kind, (right, asked) in self.qa_by_kind.items():
            lines.append(f"  QA {kind:<7} {right:4d}/{asked:<4d} = {100 * right / max(1, asked):.1f} %")
        return "\n".join(lines)


def heldout_scenes(n: int, seed: int) -> Iterator[EvalScene]:
    """The first ``n`` scenes of held-out stream ``seed`` with their questions (deterministic)."""
    for index in range(n):
        rng = scene_rng(EVAL_NAMESPACE, seed, index)
        image, objects = draw_scene(rng)
        qa_rng = random.Random(rng.getrandbits(64))
        questions = [caption_qa(objects)]
        for kind in ("count", "colour", "exists"):
            qa = sample_qa(objects, qa_rng, kind)
            if qa is not None:
                questions.append(qa)
        yield EvalScene(image, objects, questions)


def _score_caption(answer: str, objects: Sequence[SceneObject]) -> tuple[int, int, int, int]:
    """``(exact, colours right, shapes right, count right)`` for one generated caption."""
    truth = [(obj.colour, obj.shape) for obj in objects]
    parsed = parse_caption(answer)
    if parsed is None:
        return 0, 0, 0, 0
    colours = sum(i < len(parsed) and parsed[i][0] == c for i, (c, _) in enumerate(truth))
    shapes = sum(i < len(parsed) and parsed[i][1] == s for i, (_, s) in enumerate(truth))
    return int(parsed == truth), colours, shapes, int(len(parsed) == len(truth))


def evaluate(generate_fn: GenerateFn, n: int = 500, seed: int = 0, batch_size: int = 64) -> EvalReport:
    """Run ``generate_fn`` on every question of ``n`` held-out scenes, in batches; score it.

    Raises:
        ValueError: if ``n`` < 1 or ``generate_fn`` returns the wrong number of answers.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    scenes = list(heldout_scenes(n, seed))
    jobs = [(scene, qa) for scene in scenes for qa in scene.questions]
    answers: list[str] = []
    for start in tqdm(range(0, len(jobs), batch_size), desc="eval", unit="batch", dynamic_ncols=True):
        chunk = jobs[start : start + batch_size]
        out = generate_fn([(scene.image, qa.question) for scene, qa in chunk])
        if len(out) != len(chunk):
            raise ValueError(f"generate_fn returned {len(out)} answers for {len(chunk)} questions")
        answers += [text.strip() for text in out]
    exact = colours = shapes = counts = total_shapes = 0
    by_kind: dict[str, tuple[int, int]] = {}
    for (scene, qa), answer in zip(jobs, answers, strict=True):
        if qa.kind == "caption":
            e, c, s, k = _score_caption(answer, scene.objects)
            exact, colours, shapes, counts = exact + e, colours + c, shapes + s, counts + k
            total_shapes += len(scene.objects)
        else:
            right, asked = by_kind.get(qa.kind, (0, 0))
            by_kind[qa.kind] = (right + int(answer == qa.answer), asked + 1)
    qa_right = sum(right for right, _ in by_kind.values())
    qa_asked = sum(asked for _, asked in by_kind.values())
    return EvalReport(
        n=n,
        caption_exact=exact / n,
        colour=colours / total_shapes,
        shape=shapes / total_shapes,
        count=counts / n,
        qa=qa_right / max(1, qa_asked),
        qa_by_kind=by_kind,
    )


def load_processor(model_dir: Path) -> LlavaProcessor:
    """The checkpoint's ``LlavaProcessor`` with the PIL-backend ``CLIPImageProcessorPil`` (as in training)
    and a left-padding tokenizer, ready for batched generation."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    return LlavaProcessor(
        image_processor=CLIPImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )


def hf_generate_fn(model_dir: Path, max_new_tokens: int = 24) -> GenerateFn:
    """A :data:`GenerateFn` on transformers' ``LlavaForConditionalGeneration.generate`` (greedy, float32)."""
    processor = load_processor(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(batch: Sequence[tuple[Image.Image, str]]) -> list[str]:
        prompts = [user_prompt(question, with_image=True) for _, question in batch]
        inputs = processor(images=[image for image, _ in batch], text=prompts, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new_tokens = out[:, inputs["input_ids"].shape[1] :]
        return processor.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)

    return generate


def mm_serve_generate_fn(model_dir: Path, max_new_tokens: int = 24) -> GenerateFn:
    """A :data:`GenerateFn` on mm-serve's own engine, the offline ``LLM`` (greedy)."""
    from mm_serve.offline.llm import LLM
    from mm_serve.runtime.sampling_params import SamplingParams

    llm = LLM(model=str(model_dir))
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)

    def generate(batch: Sequence[tuple[Image.Image, str]]) -> list[str]:
        requests = [{"prompt": user_prompt(q, with_image=True), "images": [image]} for image, q in batch]
        return [output.text for output in llm.generate(requests, params)]

    return generate
