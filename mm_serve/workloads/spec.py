"""The shape of one benchmark request, the workload protocol, and the sampling helpers they share.

A :class:`RequestSpec` gives lengths in tokens and the identities that decide what a
server may share between requests: the conversation a turn belongs to (its history is
the earlier turns, sent and answered), the image seed (two specs with the same
``image_seed`` send the same image bytes), and a shared system prompt. The request
bodies are built from specs by :mod:`mm_serve.bench.requests` (the load generator).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class WorkloadError(ValueError):
    """A workload name, file or parameter is invalid; the message says which."""


@dataclass(frozen=True)
class RequestSpec:
    """One request's shape. Lengths in tokens; ``arrival_s`` only for trace rows.

    For a turn of a conversation (``conversation_id`` set), ``prompt_tokens`` counts
    only the new user text of that turn: the history before it is what the earlier
    turns of the conversation sent and got back, known only once they are answered.
    """

    prompt_tokens: int  # text tokens of the prompt (image tokens excluded)
    output_tokens: int  # tokens to generate, first token included (>= 1)
    num_images: int = 0
    image_tokens: int = 0  # LLM tokens per image (e.g. 576 for LLaVA-1.5)
    arrival_s: float | None = None  # trace timestamp, seconds
    conversation_id: str | None = None  # turns of one conversation share it (closed loop)
    turn: int = 0  # 0-based position in its conversation
    image_seed: int | None = None  # specs with the same seed send the same image bytes; None = fresh
    shared_prefix_tokens: int = 0  # the first this many of prompt_tokens: a system prompt shared by all
    num_videos: int = 0
    video_tokens: int = 0  # LLM tokens per video (its temporal patches' tokens, e.g. 2 x 256)

    @property
    def total_prompt_tokens(self) -> int:
        """Prompt tokens the LLM prefills: text plus image and video tokens (a turn's history excluded)."""
        return self.prompt_tokens + self.num_images * self.image_tokens + self.num_videos * self.video_tokens


class Workload(Protocol):
    """A seeded request sampler."""

    @property
    def name(self) -> str:
        """Short name shown in reports (e.g. ``chatbot``)."""
        ...

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        """Draw ``n`` requests; the same ``(n, seed)`` always gives the same list.

        A conversational workload returns whole conversations, each one's turns
        contiguous and in turn order, so that the list may be a few turns longer than ``n``.
        """
        ...


def is_conversational(workload: Workload) -> bool:
    """True when ``workload`` sends multi-turn conversations (closed loop per conversation)."""
    return bool(getattr(workload, "conversational", False))


def conversation_groups(ids: Sequence[str | None]) -> list[list[int]]:
    """Positions grouped by conversation id, groups in the order of their first position;
    a ``None`` id (a request outside any conversation) is a group of its own."""
    groups: list[list[int]] = []
    by_id: dict[str, list[int]] = {}
    for i, cid in enumerate(ids):
        if cid is None:
            groups.append([i])
        elif cid in by_id:
            by_id[cid].append(i)
        else:
            by_id[cid] = [i]
            groups.append(by_id[cid])
    return groups


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """``exp(N(ln median, sigma))`` rounded and clipped to ``[lo, hi]``."""
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def fit_context(prompt: int, output: int, max_context: int) -> tuple[int, int]:
    """Clip output first, then prompt, so that prompt + output <= max_context."""
    output = max(1, min(output, max_context - prompt))
    prompt = min(prompt, max_context - output)
    return prompt, output
