"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

Each random request draws from its own ``torch.Generator``, so its tokens
depend only on its seed and its own logits, never on batch composition. The
generator is re-seeded before every draw from (request seed, output position)
(:func:`position_seed`, a counter-based stream in the spirit of Philox / JAX's
``fold_in``), so the token at position ``k`` depends on nothing that happened before
it but the logits: a request moved to another worker (a hand-off, a migration after a
fault, a preemption recompute) continues the same random stream from its position
with no generator state to carry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mm_serve.runtime.logit_controls import adjust_logits
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.runtime.structured_output import GrammarBook

if TYPE_CHECKING:
    from mm_serve.runtime.request import Request


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for output token ``position`` (0-based) of a request seeded ``seed``.

    SplitMix64's finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014) over ``seed + (position + 1) * golden``: distinct
    positions give unrelated 64-bit seeds. Any int ``seed`` is accepted (taken mod 2**64).
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (one per request)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k set and outside the top-p nucleus of ``logits`` ``[V]``.

    The nucleus keeps the smallest prefix of tokens, sorted by probability,
    whose mass reaches ``top_p``; the most likely token is always kept.
    """
    out = logits
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


class Sampler:
    """Picks one token per row of a logits batch ``[B, V]`` (float32, any device).

    Sampled rows are drawn on the CPU with each request's CPU generator, so a seed
    gives the same tokens whatever device the logits came from.
    """

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """Next token id per row.

        Raises:
            ValueError: a random (temperature > 0) row has no generator.
        """
        tokens = torch.argmax(logits, dim=-1).tolist()
        rows = [row for row, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        host = logits.float().cpu()  # sampled rows draw on the CPU: generators are CPU ones
        temperature = torch.tensor([params[row].temperature for row in rows], dtype=torch.float32)
        scaled = host[rows] / temperature.unsqueeze(1)  # [R, V]: one division and one softmax for every row
        for i, row in enumerate(rows):
            p = params[row]
            if 0 < p.top_k < scaled.shape[-1] or p.top_p < 1.0:
                scaled[i] = filter_top_k_top_p(scaled[i], p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            gen = generators[row]
            if gen is None:
                raise ValueError("a sampled (temperature > 0) request needs a generator")
            noise[i].exponential_(1, generator=gen)
        # torch.multinomial(probs[i], 1, generator=gen) draws exactly this, one row at a time: q ~ Exp(1) from
        # the generator, then argmax(p / q) (ATen's Distributions.cpp, the Gumbel-max trick in exponential
        # form); dividing and taking the argmax of every row at once picks the same tokens for less
        for row, token in zip(rows, torch.argmax(probs / noise, dim=-1).tolist(), strict=True):
            tokens[row] = token
        return tokens

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int | None]) -> list[dict[int, float] | None]:
        """Log-probabilities of the chosen token plus the ``top_n`` best, per row (None where not asked)."""
        out: list[dict[int, float] | None] = []
        logp = None
        for row, n in enumerate(top_n):
            if n is None:
                out.append(None)
                continue
            if logp is None:
                logp = torch.log_softmax(logits, dim=-1)
            entry = {tokens[row]: float(logp[row, tokens[row]])}
            if n:
                values, ids = torch.topk(logp[row], n)
                entry.update({int(i): float(v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)})
            out.append(entry)
        return out


def sample_requests(
    sampler: Sampler, logits: torch.Tensor, batch: list[Request], eos_token_ids: frozenset[int] = frozenset(),
    grammars: GrammarBook | None = None,
) -> tuple[list[int], list[dict[int, float] | None]]:
    """Next token and (if asked) log-probabilities for each request of a step (``logits`` ``[B, V]``),
    in batch order. Each token is picked from the logits as the request adjusts them
    (:func:`~mm_serve.runtime.logit_controls.adjust_logits`: ``min_tokens``, with ``eos_token_ids``
    as stop tokens unless it ignores EOS; ``logit_bias``; penalties), each sampled request drawing from
    its own ``generator``, re-seeded with :func:`position_seed` of its ``seed`` and the position of the
    token it draws (``output_offset`` + outputs so far) when the request has a seed. A structured request's
    tokens are restricted to those its grammar allows (``grammars``' mask, before the adjustments) and
    each is fed to its matcher. Log-probabilities are the model's own (before the adjustments, as vLLM's
    default).

    Raises:
        ValueError: a structured request without ``grammars`` (the process has no grammar book).
    """
    params = [r.sampling_params for r in batch]
    for r in batch:
        if r.generator is not None and r.seed is not None:
            r.generator.manual_seed(position_seed(r.seed, r.output_offset + len(r.output_token_ids)))
    chosen = logits
    if any(p.structured is not None for p in params):
        if grammars is None:
            raise ValueError("a structured request reached a process without a grammar book")
        chosen = logits.float().clone()
        grammars.mask(chosen, batch)
    tokens = sampler.sample(adjust_logits(chosen, batch, eos_token_ids), params, [r.generator for r in batch])
    if grammars is not None:
        tokens = grammars.accept(batch, tokens)
    return tokens, sampler.logprobs(logits, tokens, [p.logprobs for p in params])
