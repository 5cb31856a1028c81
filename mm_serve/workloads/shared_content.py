"""Workloads whose requests share content, for measuring prefix and encoder caches.

=================  ==========================================================================
workload           requests
=================  ==========================================================================
multiturn-llava    conversations of ``turns`` (5) turns: turn 1 sends one image and a question
                   (log-normal median 24 tokens, sigma 0.5, in [4, 128]); turns 2-5 each a
                   follow-up question (median 16, sigma 0.5, in [4, 64]); every answer
                   log-normal median 48, sigma 0.6, in [4, 256]. Turn k + 1 is sent when
                   turn k has been answered, with the whole history (the image again)
shared-prompt      one ``system_tokens`` (400) token system prompt, the same text for every
                   request of a run, then a question (median 24, in [4, 64]); answer as above
caption-repeat     the caption workload (one image, a 12-token instruction, 20-40 tokens out)
                   where each image comes ``repeats`` (3) times with the same instruction:
                   blocks of ``block_images`` (4) images, each block's requests shuffled
=================  ==========================================================================

Every sampler is prefix-consistent (the first ``n`` requests do not depend on how
many more are drawn), like the other workloads, so a rate sweep replays one list.
A multiturn conversation is kept within the model's context: the answers, then the
questions, of the last turns are clipped once the history would not fit.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from mm_serve.workloads.spec import RequestSpec, fit_context, lognormal_int

TEMPLATE_TOKENS_PER_MESSAGE = 8  # a chat template's role markers per message, a generous estimate


@dataclass(frozen=True)
class MultiturnLlavaWorkload:
    """Image chat, ``turns`` turns per conversation (see the module table); lengths in tokens."""

    image_tokens: int
    max_context: int = 4096
    turns: int = 5
    name: str = "multiturn-llava"
    conversational: ClassVar[bool] = True  # turns are sent closed-loop, with their history

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        """``ceil(n / turns)`` whole conversations, ids ``c0``, ``c1``, ..., turns in order."""
        rows: list[RequestSpec] = []
        for c in range(math.ceil(n / self.turns)):
            rows += self._conversation(f"c{c}", random.Random(f"multiturn-llava:{seed}:{c}"))
        return rows

    def _conversation(self, cid: str, rng: random.Random) -> list[RequestSpec]:
        left = self.max_context - self.image_tokens
        turns = []
        for t in range(self.turns):
            question = lognormal_int(rng, 24, 0.5, 4, 128) if t == 0 else lognormal_int(rng, 16, 0.5, 4, 64)
            output = lognormal_int(rng, 48, 0.6, 4, 256)
            left -= 2 * TEMPLATE_TOKENS_PER_MESSAGE
            if left < 2:  # no room for another question and answer
                break
            question, output = fit_context(question, output, left)
            left -= question + output
            images = 1 if t == 0 else 0
            turns.append(RequestSpec(question, output, images, self.image_tokens * images,
                                     conversation_id=cid, turn=t))
        return turns


@dataclass(frozen=True)
class SharedPromptWorkload:
    """Chat with one ``system_tokens``-token system prompt shared by every request (module table)."""

    system_tokens: int = 400
    max_context: int = 4096
    name: str = "shared-prompt"

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"shared-prompt:{seed}")
        rows = []
        for _ in range(n):
            question = lognormal_int(rng, 24, 0.5, 4, 64)
            output = lognormal_int(rng, 48, 0.6, 4, 256)
            prompt, output = fit_context(self.system_tokens + question, output, self.max_context)
            rows.append(RequestSpec(prompt, output, shared_prefix_tokens=min(prompt, self.system_tokens)))
        return rows


@dataclass(frozen=True)
class CaptionRepeatWorkload:
    """Captioning where every image comes ``repeats`` times, shuffled within blocks (module table).

    A run of a multiple of ``repeats * block_images`` requests has every image exactly
    ``repeats`` times; a shorter tail cuts the last block.
    """

    image_tokens: int
    repeats: int = 3
    block_images: int = 4
    name: str = "caption-repeat"

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        per_block = self.repeats * self.block_images
        rows: list[RequestSpec] = []
        for b in range(math.ceil(n / per_block)):
            rng = random.Random(f"caption-repeat:{seed}:{b}")
            images = [b * self.block_images + i for i in range(self.block_images)]
            order = [image for image in images for _ in range(self.repeats)]
            rng.shuffle(order)
            rows += [RequestSpec(12, rng.randint(20, 40), 1, self.image_tokens, image_seed=image)
                     for image in order]
        return rows[:n]
