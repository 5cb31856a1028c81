"""Built-in benchmark workloads and arrival processes, as seeded pure-Python samplers.

A workload draws :class:`RequestSpec` rows (prompt length, output length, images);
an arrival process draws the request times. Both are deterministic for a given seed,
so ``mm-serve bench`` and the placement simulator (``mm-serve plan``) replay exactly
the same requests.

Length distributions (tokens; log-normal = ``exp(N(ln median, sigma))``, rounded,
then clipped to ``[min, cap]``; a pair whose prompt + output exceeds the model's
context is clipped output-first):

=========  ===========================================  ================================
workload   prompt                                       output
=========  ===========================================  ================================
chatbot    text, log-normal median 100, sigma 1.0,      log-normal median 250, sigma 0.9,
           in [4, 1024] (mean ~160)                     in [4, 1024] (mean ~340)
llava      1 image (``image_tokens``) + question,       log-normal median 48, sigma 0.6,
           log-normal median 24, sigma 0.5, in [4, 128]  in [4, 256]
caption    1 image + a fixed 12-token instruction        uniform integer in [20, 40]
=========  ===========================================  ================================

The chatbot mix matches the ShareGPT statistics reported by Kwon et al. (vLLM,
SOSP 2023, Fig. 11a: mean input 161, mean output 338 tokens), the dataset of
DistServe's chatbot workload (arXiv:2401.09670, §6.1); the log-normal shape gives
ShareGPT's long tail of long prompts and long answers.

JSONL workload file: one JSON object per line with ``output_len`` and either
``prompt_len`` (text tokens) or ``prompt`` (text; length estimated as
``ceil(len(prompt) / 4)`` tokens unless a token counter is given), and optionally
``num_images`` (default 0) and ``timestamp`` (arrival time in seconds; a file whose
rows all carry one is a *trace* and is replayed in order). Blank lines and lines
starting with ``#`` are skipped.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol


class WorkloadError(ValueError):
    """A workload name, file or parameter is invalid; the message says which."""


@dataclass(frozen=True)
class RequestSpec:
    """One request's shape. Lengths in tokens; ``arrival_s`` only for trace rows."""

    prompt_tokens: int  # text tokens of the prompt (image tokens excluded)
    output_tokens: int  # tokens to generate, first token included (>= 1)
    num_images: int = 0
    image_tokens: int = 0  # LLM tokens per image (e.g. 576 for LLaVA-1.5)
    arrival_s: float | None = None  # trace timestamp, seconds

    @property
    def total_prompt_tokens(self) -> int:
        """Prompt tokens the LLM prefills: text plus image tokens."""
        return self.prompt_tokens + self.num_images * self.image_tokens


class Workload(Protocol):
    """A seeded request sampler."""

    @property
    def name(self) -> str:
        """Short name shown in reports (e.g. ``chatbot``)."""
        ...

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        """Draw ``n`` requests; the same ``(n, seed)`` always gives the same list."""
        ...


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def _fit_context(prompt: int, output: int, max_context: int) -> tuple[int, int]:
    """Clip output first, then prompt, so that prompt + output <= max_context."""
    output = max(1, min(output, max_context - prompt))
    prompt = min(prompt, max_context - output)
    return prompt, output


@dataclass(frozen=True)
class ChatbotWorkload:
    """ShareGPT-like text chat (see the module table); lengths in tokens."""

    max_context: int = 4096
    name: str = "chatbot"

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"chatbot:{seed}")
        rows = []
        for _ in range(n):
            prompt = _lognormal_int(rng, 100, 1.0, 4, 1024)
            output = _lognormal_int(rng, 250, 0.9, 4, 1024)
            prompt, output = _fit_context(prompt, output, self.max_context)
            rows.append(RequestSpec(prompt, output))
        return rows


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
            question = _lognormal_int(rng, 24, 0.5, 4, 128)
            output = _lognormal_int(rng, 48, 0.6, 4, 256)
            text, output = _fit_context(question, output, self.max_context - self.image_tokens)
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
class JsonlWorkload:
    """Rows read from a JSONL file (format in the module docstring).

    A trace (every row timestamped) is replayed in file order, cycling with the
    time offset of one full pass when more rows are asked for; otherwise rows are
    drawn uniformly with replacement from the seeded generator.
    """

    rows: tuple[RequestSpec, ...]
    name: str = "jsonl"

    @property
    def is_trace(self) -> bool:
        return all(r.arrival_s is not None for r in self.rows)

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        if not self.is_trace:
            rng = random.Random(f"jsonl:{seed}")
            return [rng.choice(self.rows) for _ in range(n)]
        span = max(r.arrival_s or 0.0 for r in self.rows)
        span += span / max(1, len(self.rows) - 1)
        out = []
        for i in range(n):
            row = self.rows[i % len(self.rows)]
            offset = span * (i // len(self.rows))
            out.append(
                RequestSpec(row.prompt_tokens, row.output_tokens, row.num_images,
                            row.image_tokens, (row.arrival_s or 0.0) + offset)
            )
        return out


def _row_int(row: dict[str, object], key: str, where: str, default: int | None = None) -> int:
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WorkloadError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def load_jsonl_workload(
    path: str | Path, image_tokens: int = 0, count_tokens: Callable[[str], int] | None = None
) -> JsonlWorkload:
    """Read a JSONL workload file; raises :class:`WorkloadError` naming the bad line."""
    p = Path(path)
    if p.is_dir():
        raise WorkloadError(f"workload {p} is a directory, not a JSONL file")
    if not p.is_file():
        raise WorkloadError(f"workload file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    rows: list[RequestSpec] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{p}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: each line must be a JSON object")
        if "prompt_len" in row:
            prompt = _row_int(row, "prompt_len", where)
        elif isinstance(row.get("prompt"), str):
            text = str(row["prompt"])
            prompt = count_tokens(text) if count_tokens else math.ceil(len(text) / 4)
        else:
            raise WorkloadError(f"{where}: needs 'prompt_len' or 'prompt'")
        output = _row_int(row, "output_len", where)
        if output < 1:
            raise WorkloadError(f"{where}: 'output_len' must be >= 1")
        stamp = row.get("timestamp")
        if stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, (int, float))
                                  or not math.isfinite(stamp) or stamp < 0):
            raise WorkloadError(f"{where}: 'timestamp' must be a number >= 0 (seconds), got {stamp!r}")
        images = _row_int(row, "num_images", where, 0)
        if prompt + images * image_tokens < 1 and not (images and image_tokens == 0):
            raise WorkloadError(f"{where}: a request needs at least one prompt token (or an image)")
        rows.append(RequestSpec(prompt, output, images, image_tokens if images else 0,
                                None if stamp is None else float(stamp)))
    if not rows:
        raise WorkloadError(f"{p}: no requests")
    stamped = sum(r.arrival_s is not None for r in rows)
    if 0 < stamped < len(rows):
        raise WorkloadError(f"{p}: {stamped} of {len(rows)} rows have a 'timestamp': give every "
                            "row one (a trace) or none (arrivals drawn at the requested rate)")
    if stamped and len({r.arrival_s for r in rows}) < 2:
        raise WorkloadError(f"{p}: a trace needs at least two different 'timestamp' values "
                            "(it is replayed at a rate scaled from their spacing)")
    if stamped:  # arrival order, first at 0: epoch or offset timestamps replay the same
        rows.sort(key=lambda r: r.arrival_s or 0.0)
        first = rows[0].arrival_s or 0.0
        rows = [replace(r, arrival_s=(r.arrival_s or 0.0) - first) for r in rows]
    return JsonlWorkload(tuple(rows), name=p.stem)


BUILTIN_WORKLOADS = ("chatbot", "llava", "caption")
MAX_BURSTINESS = 100.0  # CV of the gaps; beyond it a gamma draw underflows to all-at-once
MIN_BURSTINESS = 0.001  # below it the gamma shape 1 / CV^2 overflows; 0.001 is already periodic


def make_workload(name_or_path: str, image_tokens: int = 0, max_context: int = 4096) -> Workload:
    """A built-in workload by name, or a JSONL workload file by path.

    ``image_tokens`` (LLM tokens per image, from the model shape) is required by
    the image workloads; raises :class:`WorkloadError` otherwise.
    """
    if name_or_path == "chatbot":
        return ChatbotWorkload(max_context=max_context)
    if name_or_path in ("llava", "caption"):
        if image_tokens <= 0:
            raise WorkloadError(f"workload '{name_or_path}' needs a model with a vision tower")
        least = image_tokens + (12 if name_or_path == "caption" else 4) + 40
        if least > max_context:
            raise WorkloadError(
                f"workload '{name_or_path}': an image is {image_tokens} tokens, and with its "
                f"question and answer a request needs about {least}, more than the model's "
                f"{max_context}-token context")
        if name_or_path == "llava":
            return LlavaWorkload(image_tokens, max_context=max_context)
        return CaptionWorkload(image_tokens)
    if name_or_path.endswith(".jsonl") or Path(name_or_path).is_file():
        return load_jsonl_workload(name_or_path, image_tokens)
    raise WorkloadError(
        f"unknown workload '{name_or_path}'; choose {', '.join(BUILTIN_WORKLOADS)} or a .jsonl file"
    )


def check_burstiness(cv: float) -> None:
    """Raises :class:`WorkloadError` unless ``MIN_BURSTINESS <= cv <= MAX_BURSTINESS``."""
    if not MIN_BURSTINESS <= cv <= MAX_BURSTINESS:
        raise WorkloadError(f"burstiness (CV) must be in {MIN_BURSTINESS:g}..{MAX_BURSTINESS:g}, got {cv}")


def unit_rate_arrivals(n: int, seed: int, cv: float = 1.0) -> list[float]:
    """Arrival times (seconds) of ``n`` requests at mean rate 1 request/s.

    Gaps are gamma-distributed with shape ``1 / cv**2`` and mean 1, so ``cv = 1`` is
    a Poisson process and ``cv > 1`` is burstier. Divide by a rate R (requests/s) to
    get the same sample path at rate R (common random numbers across rates).
    """
    check_burstiness(cv)
    rng = random.Random(f"arrivals:{seed}:{cv}")
    shape = 1.0 / (cv * cv)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0) if cv == 1.0 else rng.gammavariate(shape, 1.0 / shape)
        out.append(t)
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds) at ``rate`` requests/s."""
    return gamma_arrivals(n, rate, 1.0, seed)


def gamma_arrivals(n: int, rate: float, cv: float, seed: int) -> list[float]:
    """Gamma-renewal arrival times (seconds) at ``rate`` requests/s with gap CV ``cv``."""
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0 requests/s, got {rate}")
    return [t / rate for t in unit_rate_arrivals(n, seed, cv)]


def trace_arrivals(specs: Sequence[RequestSpec], rate: float | None = None) -> list[float]:
    """Arrival times from trace timestamps, rescaled to mean ``rate`` requests/s if given."""
    stamps = [s.arrival_s or 0.0 for s in specs]
    if rate is None or len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return stamps
    scale = (len(stamps) - 1) / (rate * (stamps[-1] - stamps[0]))
    return [(t - stamps[0]) * scale for t in stamps]
