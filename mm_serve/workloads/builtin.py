"""Built-in workloads, as seeded pure-Python samplers, and :func:`make_workload`.

A workload draws :class:`~mm_serve.workloads.spec.RequestSpec` rows (prompt length,
output length, images), deterministic for a given seed, so ``mm-serve bench`` and the
placement simulator (``mm-serve plan``) replay exactly the same requests (their
arrival times: :mod:`mm_serve.workloads.arrivals`).

Length distributions (tokens; log-normal = ``exp(N(ln median, sigma))``, rounded,
then clipped to ``[min, cap]``; a pair whose prompt + output exceeds the model's
context is clipped output-first):

===============  ==========================================  =================================
workload         prompt                                      output
===============  ==========================================  =================================
chatbot          text, log-normal median 100, sigma 1.0,     log-normal median 250, sigma 0.9,
                 in [4, 1024] (mean ~160)                    in [4, 1024] (mean ~340)
code             text, log-normal median 124, sigma 0.52,    log-normal median 46, sigma 0.72,
                 in [36, 425]                                in [5, 270]
summarization    text, log-normal median 1600, sigma 0.35,   log-normal median 96, sigma 0.5,
                 in [768, context - 512]                     in [16, 400]
llava            1 image (``image_tokens``) + question,      log-normal median 48, sigma 0.6,
                 log-normal median 24, sigma 0.5, in [4, 128] in [4, 256]
long-multimodal  2-4 images (uniform) + a document,          log-normal median 64, sigma 0.6,
                 log-normal median 900, sigma 0.5, in        in [8, 256]
                 [200, 2048], + a question as in llava
caption          1 image + a fixed 12-token instruction      uniform integer in [20, 40]
short-video      1 short video (``video_tokens``) + a        log-normal median 64, sigma 0.6,
                 question as in llava                        in [8, 256]
===============  ==========================================  =================================

The chatbot mix matches the ShareGPT statistics reported by Kwon et al. (vLLM,
SOSP 2023, Fig. 11a: mean input 161, mean output 338 tokens), the dataset of
DistServe's chatbot workload (arXiv:2401.09670, §6.1); the log-normal shape gives
ShareGPT's long tail of long prompts and long answers.

``code`` and ``summarization`` are DistServe's other two applications (§6.1): code
completion on HumanEval and summarization on LongBench. ``code`` is fitted to the 164
HumanEval problems (openai/human-eval): the prompt (signature and docstring) has a
median of 396 characters and a p90 of 775, the canonical solution 148.5 and 373; at
3.2 characters per token (code with a Llama-family BPE) that is the median and
p90 of the table's log-normals, clipped at the dataset's shortest and longest.
``summarization`` is shaped on LongBench's summarization tasks, whose documents
(thousands of words) are longer than any context here: as DistServe had to keep
them within OPT's 2,048-token window, the prompt is a long document cut to fit
the model's context (median 1,600 tokens, 80 % between 1,000 and 2,500 with a 4K
context, so that prefill is the bulk of the work) and the summary is short (median 96 tokens). Its
lengths are our shape, not a fit: the data set cannot be downloaded here.
``long-multimodal`` is ours: several images plus a long document and a question
(a report with figures, a slide deck), for prefill-heavy multimodal traffic. ``short-video`` too:
a few-second clip and a question about it (models that take video, Qwen2-VL); the bench sends
clips whose frames the server samples into a few temporal patches (:mod:`mm_serve.bench.requests`).

The workloads whose requests share content (``multiturn-llava``, ``shared-prompt``,
``caption-repeat``) are in :mod:`mm_serve.workloads.shared_content`; JSONL workload files
(traces and conversations too) in :mod:`mm_serve.workloads.jsonl`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from mm_serve.workloads.jsonl import load_jsonl_workload
from mm_serve.workloads.shared_content import (
    CaptionRepeatWorkload,
    MultiturnLlavaWorkload,
    SharedPromptWorkload,
)
from mm_serve.workloads.spec import RequestSpec, Workload, WorkloadError, fit_context, lognormal_int


@dataclass(frozen=True)
class LogNormalLength:
    """A length in tokens: ``exp(N(ln median, sigma))`` rounded, clipped to ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: random.Random, hi: int | None = None) -> int:
        """One length; ``hi`` (if given) lowers the cap."""
        return lognormal_int(rng, self.median, self.sigma, self.lo, self.hi if hi is None else min(hi, self.hi))


@dataclass(frozen=True)
class TextWorkload:
    """Text requests: a prompt and an output length, each log-normal (the module table), fitted
    to ``max_context`` output-first; the prompt is also capped at ``max_context - prompt_room``."""

    name: str
    prompt: LogNormalLength
    output: LogNormalLength
    max_context: int = 4096
    prompt_room: int = 0  # tokens of context the prompt leaves free (summaries need room)

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"{self.name}:{seed}")
        cap = max(self.prompt.lo, self.max_context - self.prompt_room) if self.prompt_room else None
        rows = []
        for _ in range(n):
            prompt = self.prompt.draw(rng, cap)
            output = self.output.draw(rng)
            rows.append(RequestSpec(*fit_context(prompt, output, self.max_context)))
        return rows


def ChatbotWorkload(max_context: int = 4096) -> TextWorkload:  # noqa: N802 (a workload, named like the others)
    """ShareGPT-like text chat (see the module table); lengths in tokens."""
    return TextWorkload("chatbot", LogNormalLength(100, 1.0, 4, 1024), LogNormalLength(250, 0.9, 4, 1024), max_context)


def CodeWorkload(max_context: int = 4096) -> TextWorkload:  # noqa: N802
    """HumanEval-like code completion: short prompts, short answers (see the module table)."""
    return TextWorkload("code", LogNormalLength(124, 0.52, 36, 425), LogNormalLength(46, 0.72, 5, 270), max_context)


def SummarizationWorkload(max_context: int = 4096) -> TextWorkload:  # noqa: N802
    """LongBench-like summarization: a long document, a short summary (see the module table).

    Needs a context of at least 1,296 tokens (the shortest document and summary, 784, plus
    512 of room). The module's median and spread hold for contexts of 4K and more; below,
    documents are capped at ``context - 512`` (at 2,048 about half of them sit at 1,536).
    """
    return TextWorkload("summarization", LogNormalLength(1600, 0.35, 768, 1 << 30),
                        LogNormalLength(96, 0.5, 16, 400), max_context, prompt_room=512)


def question_and_answer(rng: random.Random, room: int, answer_median: int, answer_lo: int) -> tuple[int, int]:
    """(question, answer) tokens of a request about one image or video: a question log-normal median 24,
    sigma 0.5, in [4, 128], an answer log-normal ``answer_median``, sigma 0.6, in [``answer_lo``, 256], both
    fitted to the ``room`` tokens its media leaves (:func:`fit_context`)."""
    question = lognormal_int(rng, 24, 0.5, 4, 128)
    answer = lognormal_int(rng, answer_median, 0.6, answer_lo, 256)
    return fit_context(question, answer, room)


@dataclass(frozen=True)
class LlavaWorkload:
    """One image plus a short question, short answer (see the module table)."""

    image_tokens: int
    max_context: int = 4096
    name: str = "llava"

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"llava:{seed}")
        rows = []
        for _ in range(n):
            text, output = question_and_answer(rng, self.max_context - self.image_tokens, 48, 4)
            rows.append(RequestSpec(text, output, 1, self.image_tokens))
        return rows


@dataclass(frozen=True)
class CaptionWorkload:
    """One image, a fixed 12-token instruction, 20-40 output tokens."""

    image_tokens: int
    name: str = "caption"

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"caption:{seed}")
        return [RequestSpec(12, rng.randint(20, 40), 1, self.image_tokens) for _ in range(n)]


@dataclass(frozen=True)
class LongMultimodalWorkload:
    """2-4 images, a long document and a question; short answers (see the module table)."""

    image_tokens: int
    max_context: int = 4096
    max_images: int = 4  # the server's api.max_images_per_request
    name: str = "long-multimodal"

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"long-multimodal:{seed}")
        rows = []
        for _ in range(n):
            images = rng.randint(min(2, self.max_images), self.max_images)
            document = lognormal_int(rng, 900, 0.5, 200, 2048) + lognormal_int(rng, 24, 0.5, 4, 128)
            output = lognormal_int(rng, 64, 0.6, 8, 256)
            while images > 1 and images * self.image_tokens + 200 + 8 > self.max_context:
                images -= 1  # a large image for this context: fewer of them
            room = self.max_context - images * self.image_tokens
            output = max(1, min(output, room - 200))  # the document keeps its first 200 tokens at least
            text = max(1, min(document, room - output))  # then is cut to what is left
            rows.append(RequestSpec(text, output, images, self.image_tokens))
        return rows


@dataclass(frozen=True)
class ShortVideoWorkload:
    """One short video plus a question; short answers (see the module table)."""

    video_tokens: int
    max_context: int = 4096
    name: str = "short-video"

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"short-video:{seed}")
        rows = []
        for _ in range(n):
            text, output = question_and_answer(rng, self.max_context - self.video_tokens, 64, 8)
            rows.append(RequestSpec(text, output, num_videos=1, video_tokens=self.video_tokens))
        return rows


BUILTIN_WORKLOADS = ("chatbot", "code", "summarization", "llava", "long-multimodal", "caption",
                     "multiturn-llava", "shared-prompt", "caption-repeat", "short-video")
VIDEO_WORKLOADS = ("short-video",)  # need a model that takes video
IMAGE_WORKLOADS = ("llava", "long-multimodal", "caption", "multiturn-llava", "caption-repeat")  # need a vision tower
SUMMARIZATION_MIN_CONTEXT = 768 + 16 + 512  # shortest document, shortest summary, room for the tail


def make_workload(name_or_path: str, image_tokens: int = 0, max_context: int = 4096,
                  video_tokens: int = 0) -> Workload:
    """A built-in workload by name (:data:`BUILTIN_WORKLOADS`), or a JSONL workload file by path.

    ``image_tokens`` (LLM tokens per image, from the model shape) is required by
    the image workloads (:data:`IMAGE_WORKLOADS`), ``video_tokens`` (per video) by the video ones
    (:data:`VIDEO_WORKLOADS`); raises :class:`WorkloadError` otherwise.
    """
    if name_or_path in VIDEO_WORKLOADS:
        if video_tokens <= 0:
            raise WorkloadError(f"workload '{name_or_path}' needs a model that takes video (Qwen2-VL, Qwen2.5-VL)")
        if video_tokens + 4 + 40 > max_context:
            raise WorkloadError(f"workload '{name_or_path}': a video is {video_tokens} tokens, more than the model's "
                                f"{max_context}-token context holds with a question and an answer")
        return ShortVideoWorkload(video_tokens, max_context=max_context)
    if name_or_path == "chatbot":
        return ChatbotWorkload(max_context=max_context)
    if name_or_path == "code":
        return CodeWorkload(max_context=max_context)
    if name_or_path == "summarization":
        if max_context < SUMMARIZATION_MIN_CONTEXT:
            raise WorkloadError(f"workload 'summarization' needs a context of at least "
                                f"{SUMMARIZATION_MIN_CONTEXT} tokens (long documents); the model has {max_context}")
        return SummarizationWorkload(max_context=max_context)
    if name_or_path == "shared-prompt":
        return SharedPromptWorkload(max_context=max_context)
    if name_or_path in IMAGE_WORKLOADS:
        if image_tokens <= 0:
            raise WorkloadError(f"workload '{name_or_path}' needs a model with a vision tower")
        least = image_tokens + (12 if "caption" in name_or_path else 4) + 40
        if least > max_context:
            raise WorkloadError(
                f"workload '{name_or_path}': an image is {image_tokens} tokens, and with its "
                f"question and answer a request needs about {least}, more than the model's "
                f"{max_context}-token context")
        if name_or_path == "llava":
            return LlavaWorkload(image_tokens, max_context=max_context)
        if name_or_path == "long-multimodal":
            return LongMultimodalWorkload(image_tokens, max_context=max_context)
        if name_or_path == "multiturn-llava":
            return MultiturnLlavaWorkload(image_tokens, max_context=max_context)
        if name_or_path == "caption-repeat":
            return CaptionRepeatWorkload(image_tokens)
        return CaptionWorkload(image_tokens)
    if name_or_path.endswith(".jsonl") or Path(name_or_path).is_file():
        return load_jsonl_workload(name_or_path, image_tokens)
    raise WorkloadError(
        f"unknown workload '{name_or_path}'; choose {', '.join(BUILTIN_WORKLOADS)} or a .jsonl file"
    )
