"""Greedy parity: mm-serve's own runner answers exactly as transformers on the embedded checkpoint."""

from __future__ import annotations

import random

import pytest

from mm_serve.models.named_models import resolve_model
from mm_serve.shapes.dataset import user_prompt
from mm_serve.shapes.evaluate import hf_generate_fn
from mm_serve.shapes.scenes import draw_scene, scene_rng
from mm_serve.shapes.targets import QA_KINDS, sample_qa

try:
    from mm_serve import LLM, SamplingParams
except ImportError:  # the engine is not built yet
    pytest.skip("mm_serve.LLM is not importable yet", allow_module_level=True)

N_SCENES = 20
MAX_TOKENS = 24


def _jobs() -> list[tuple[object, str]]:
    """Per scene: the caption prompt and one question of a rotating QA kind."""
    jobs = []
    for index in range(N_SCENES):
        rng = scene_rng("parity", 0, index)
        image, objects = draw_scene(rng)
        qa = sample_qa(objects, random.Random(index), QA_KINDS[1 + index % 3]) or sample_qa(objects, rng, "count")
        assert qa is not None
        jobs += [(image, "Describe the image."), (image, qa.question)]
    return jobs


def test_greedy_answers_match_transformers() -> None:
    model_dir = resolve_model("embedded")
    jobs = _jobs()
    reference_fn = hf_generate_fn(model_dir, MAX_TOKENS)
    reference = [reference_fn([job])[0] for job in jobs]  # one at a time: no padding in the reference
    llm = LLM(model=str(model_dir))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    requests = [{"prompt": user_prompt(question, with_image=True), "images": [image]} for image, question in jobs]
    ours = [output.text for output in llm.generate(requests, params)]
    assert [text.strip() for text in ours] == [text.strip() for text in reference]
    assert sum(text.strip().startswith("a ") for text in reference) >= N_SCENES // 2  # real captions
