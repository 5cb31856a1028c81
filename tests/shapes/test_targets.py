"""Captions, questions and answers of a scene."""

from __future__ import annotations

import random

from mm_serve.shapes.scenes import COLOURS, SHAPES, SceneObject, draw_scene, scene_rng
from mm_serve.shapes.targets import (
    CAPTION_PROMPTS,
    COUNT_QUESTION,
    caption,
    colour_qa,
    count_qa,
    exists_qa,
    parse_caption,
    sample_qa,
)


def _obj(colour: str, shape: str, x: int) -> SceneObject:
    return SceneObject(colour, shape, (x, 0, x + 10, 10))


RED_CIRCLE, BLUE_SQUARE, GREEN_TRIANGLE = _obj("red", "circle", 0), _obj("blue", "square", 20), _obj("green", "triangle", 40)


def test_caption_grammar() -> None:
    assert caption([RED_CIRCLE]) == "a red circle"
    assert caption([RED_CIRCLE, BLUE_SQUARE]) == "a red circle and a blue square"
    assert caption([RED_CIRCLE, BLUE_SQUARE, GREEN_TRIANGLE]) == "a red circle, a blue square and a green triangle"
    assert caption([_obj("orange", "square", 0), RED_CIRCLE]) == "an orange square and a red circle"


def test_parse_caption_inverts_and_rejects() -> None:
    for objects in ([RED_CIRCLE], [RED_CIRCLE, BLUE_SQUARE], [RED_CIRCLE, BLUE_SQUARE, GREEN_TRIANGLE]):
        assert parse_caption(caption(objects)) == [(o.colour, o.shape) for o in objects]
    bad_captions = ("", "a red", "a pink circle", "a red circle, a blue square", "a red circle and a x and a y",
                    "a orange circle", "an red circle")
    for bad in bad_captions:
        assert parse_caption(bad) is None


def test_count_and_colour_questions() -> None:
    assert count_qa([RED_CIRCLE, BLUE_SQUARE]).answer == "two"
    assert count_qa([RED_CIRCLE]).question == COUNT_QUESTION
    rng = random.Random(0)
    qa = colour_qa([RED_CIRCLE, BLUE_SQUARE, _obj("yellow", "circle", 60)], rng)
    assert qa is not None and (qa.question, qa.answer) == ("What color is the square?", "blue")
    assert colour_qa([RED_CIRCLE, _obj("blue", "circle", 20)], rng) is None


def test_exists_answers_are_true_and_balanced() -> None:
    rng = random.Random(1)
    answers = []
    for i in range(400):
        _, objects = draw_scene(scene_rng("test-targets", 0, i))
        qa = exists_qa(objects, rng)
        article, *words = qa.question.removeprefix("Is there ").removesuffix("?").split()
        assert words[0] in COLOURS and words[1] in SHAPES
        assert article == ("an" if words[0] == "orange" else "a")
        present = any(o.colour == words[0] and o.shape == words[1] for o in objects)
        assert qa.answer == ("yes" if present else "no")
        answers.append(qa.answer)
    assert 150 < answers.count("yes") < 250


def test_sample_qa_every_kind() -> None:
    rng = random.Random(2)
    objects = [RED_CIRCLE, BLUE_SQUARE]
    caption_q = sample_qa(objects, rng, "caption")
    assert caption_q is not None and caption_q.question in CAPTION_PROMPTS
    assert caption_q.answer == "a red circle and a blue square"
    for kind in ("count", "colour", "exists"):
        qa = sample_qa(objects, rng, kind)
        assert qa is not None and qa.kind == kind
