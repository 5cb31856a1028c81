"""Target texts for a scene: the caption, the questions and their answers.

Caption grammar (shapes left to right; ``an`` before ``orange``)::

    a red circle
    a red circle and a blue square
    a red circle, a blue square and an orange triangle

Question kinds (``QA.kind``):

* ``caption``: ``Describe the image.`` or ``What is in this picture?`` → the caption;
* ``count``: ``How many shapes are there?`` → ``one`` | ``two`` | ``three``;
* ``colour``: ``What color is the <shape>?`` → the colour, asked only about a shape
  present exactly once;
* ``exists``: ``Is there a <colour> <shape>?`` (``an orange``) → ``yes`` | ``no``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mm_serve.shapes.scenes import COLOURS, SHAPES, SceneObject

QAKind = Literal["caption", "count", "colour", "exists"]
QA_KINDS: tuple[QAKind, ...] = ("caption", "count", "colour", "exists")
CAPTION_PROMPTS: tuple[str, ...] = ("Describe the image.", "What is in this picture?")
COUNT_QUESTION = "How many shapes are there?"
COUNT_WORDS: tuple[str, ...] = ("one", "two", "three")
_PHRASE = re.compile(r"(an?) (\w+) (\w+)")


@dataclass(frozen=True)
class QA:
    """One question about a scene with its single correct answer."""

    kind: QAKind
    question: str
    answer: str


def phrase(colour: str, shape: str) -> str:
    """``a red circle``, ``an orange square``: the article agrees with the colour word."""
    article = "an" if colour[0] in "aeiou" else "a"
    return f"{article} {colour} {shape}"


def caption(objects: Sequence[SceneObject]) -> str:
    """The caption of 1 to 3 shapes, given left to right; raises ``ValueError`` on an empty list."""
    phrases = [phrase(obj.colour, obj.shape) for obj in objects]
    if not phrases:
        raise ValueError("a caption needs at least one shape")
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def parse_caption(text: str) -> list[tuple[str, str]] | None:
    """Invert :func:`caption`: ``[(colour, shape), ...]`` left to right, or ``None`` if malformed.

    Only the exact grammar is accepted; words outside :data:`COLOURS` or
    :data:`SHAPES`, or a wrong article, make the caption malformed.
    """
    parts = text.strip().split(" and ")
    if len(parts) > 2:
        return None
    phrases = parts[0].split(", ") + parts[1:]
    if len(parts) == 1 and len(phrases) > 1:
        return None
    result = []
    for text_phrase in phrases:
        match = _PHRASE.fullmatch(text_phrase)
        if match is None or match[2] not in COLOURS or match[3] not in SHAPES:
            return None
        if phrase(match[2], match[3]) != text_phrase:
            return None
        result.append((match[2], match[3]))
    return result


def caption_qa(objects: Sequence[SceneObject], prompt: str = CAPTION_PROMPTS[0]) -> QA:
    """The caption question with ``prompt`` (one of :data:`CAPTION_PROMPTS`)."""
    return QA("caption", prompt, caption(objects))


def count_qa(objects: Sequence[SceneObject]) -> QA:
    """``How many shapes are there?``; raises ``ValueError`` for more than three shapes."""
    if not 1 <= len(objects) <= len(COUNT_WORDS):
        raise ValueError(f"scenes have 1 to 3 shapes, got {len(objects)}")
    return QA("count", COUNT_QUESTION, COUNT_WORDS[len(objects) - 1])


def unique_shapes(objects: Sequence[SceneObject]) -> list[str]:
    """Shape names present exactly once, in :data:`SHAPES` order."""
    names = [obj.shape for obj in objects]
    return [shape for shape in SHAPES if names.count(shape) == 1]


def colour_questions(objects: Sequence[SceneObject]) -> list[QA]:
    """``What color is the <shape>?`` for every shape present exactly once, in :data:`SHAPES` order."""
    return [
        QA("colour", f"What color is the {shape}?", next(o.colour for o in objects if o.shape == shape))
        for shape in unique_shapes(objects)
    ]


def colour_qa(objects: Sequence[SceneObject], rng: random.Random) -> QA | None:
    """``What color is the <shape>?`` for a random uniquely present shape; ``None`` if there is none."""
    candidates = colour_questions(objects)
    return rng.choice(candidates) if candidates else None


def exists_qa(objects: Sequence[SceneObject], rng: random.Random) -> QA:
    """``Is there a <colour> <shape>?``, answered ``yes`` or ``no`` with equal probability.

    A ``no`` question is about a colour-shape pair absent from the scene; half of
    those reuse a present shape or a present colour so the answer needs both.
    """
    present = {(obj.colour, obj.shape) for obj in objects}
    if rng.random() < 0.5:
        colour, shape = rng.choice(sorted(present))
        return QA("exists", f"Is there {phrase(colour, shape)}?", "yes")
    absent = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in present]
    near = [(c, s) for c, s in absent if any(c == pc or s == ps for pc, ps in present)]
    colour, shape = rng.choice(near if near and rng.random() < 0.5 else absent)
    return QA("exists", f"Is there {phrase(colour, shape)}?", "no")


def sample_qa(objects: Sequence[SceneObject], rng: random.Random, kind: QAKind) -> QA | None:
    """One question of ``kind`` about the scene; ``None`` only for ``colour`` with no unique shape."""
    if kind == "caption":
        return caption_qa(objects, rng.choice(CAPTION_PROMPTS))
    if kind == "count":
        return count_qa(objects)
    if kind == "colour":
        return colour_qa(objects, rng)
    return exists_qa(objects, rng)
