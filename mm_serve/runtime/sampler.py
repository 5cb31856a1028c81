"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

Each random request draws from its own ``torch.Generator``, so its tokens
depend only on its seed and its own logits, never on batch composition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mm_serve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mm_serve.runtime.request import Request


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
        host: torch.Tensor | None = None  # sampled rows draw on the CPU: generators are CPU ones
        for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
            if p.greedy:
                continue
            if gen is None:
                raise ValueError("a sampled (temperature > 0) request needs a generator")
            if host is None:
                host = logits.float().cpu()
            scaled = filter_top_k_top_p(host[row] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(scaled, dim=-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
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
    sampler: Sampler, logits: torch.Tensor, batch: list[Request]
) -> tuple[list[int], list[dict[int, float] | None]]:
    """Next token and (if asked) log-probabilities for each request of a step (``logits`` ``[B, V]``),
    in batch order, each sampled request drawing from its own ``generator``."""
    params = [r.sampling_params for r in batch]
    tokens = sampler.sample(logits, params, [r.generator for r in batch])
    return tokens, sampler.logprobs(logits, tokens, [p.logprobs for p in params])


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """Serialised CPU generator state (so the decode worker continues the same random stream)."""
    return None if generator is None else bytes(generator.get_state().numpy().tobytes())


def restore_generator(state: bytes | None) -> torch.Generator | None:
    """A CPU generator continuing from :func:`generator_state` output (None for greedy requests)."""
    if state is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator
