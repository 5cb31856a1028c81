"""The logit adjustments a request asks for, applied before sampling (greedy included): ``min_tokens``,
``logit_bias`` and the repetition, frequency and presence penalties, in vLLM's order.

For one row of logits ``l`` ``[V]`` of a request with outputs ``o`` so far (every output, those before a
migration too: they are the tail of its prompt then) and prompt ``p``:

1. ``min_tokens``: while this attempt has fewer than ``min_tokens`` outputs, ``l[t] = -inf`` for every stop
   token ``t`` (EOS unless ``ignore_eos``, and ``stop_token_ids``), as vLLM's ``MinTokensLogitsProcessor``;
   unless no other token is left (a structured output's grammar is complete and allows only a stop token).
2. ``logit_bias``: ``l[t] += bias[t]`` (OpenAI's ``logit_bias``).
3. repetition penalty ``r`` (Keskar et al. 2019, "CTRL", §4.1; vLLM's and transformers' form): for every
   token in ``p`` or ``o``, ``l[t] = l[t] / r`` where ``l[t] > 0``, else ``l[t] * r``.
4. OpenAI's penalties (the API reference's "frequency and presence penalties"):
   ``l[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)``, ``c[t]`` the count of ``t`` in ``o``.

Every term depends only on the request's own tokens, so a request gives the same tokens in any batch, on
the prefill worker (its first token), on a decode worker, colocated, after a preemption (its outputs are
kept) and after a migration (its earlier outputs come back as the prompt's tail: ``output_offset``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mm_serve.runtime.request import Request


def split_outputs(request: Request) -> tuple[list[int], list[int]]:
    """(prompt, outputs) token ids of ``request``: outputs include those before a migration (the last
    ``output_offset`` ids of its prompt then)."""
    ids = request.prompt_token_ids
    cut = len(ids) - request.output_offset
    return ids[:cut], ids[cut:] + request.output_token_ids


class TokenCounts:
    """A request's token counts for the penalties, kept on its ``logit_state`` and brought up to date with each
    new output (the prompt and earlier outputs are counted once, when it is built).

    Attributes:
        seen: ``[V]`` bool, the token occurs in the prompt or the outputs (the repetition penalty's set).
        counts: ``[V]`` float32, occurrences in the outputs.
    """

    def __init__(self, request: Request, vocab: int, device: torch.device) -> None:
        prompt, outputs = split_outputs(request)
        self.vocab = vocab
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen[self._ids(prompt, device)] = True
        self._add(outputs, device)
        self.consumed = len(request.output_token_ids)

    def _ids(self, tokens: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor([t for t in tokens if 0 <= t < self.vocab], dtype=torch.long, device=device)

    def _add(self, tokens: list[int], device: torch.device) -> None:
        ids = self._ids(tokens, device)
        self.seen[ids] = True
        self.counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float32, device=device))

    def update(self, request: Request) -> None:
        """Count the outputs ``request`` has had since the last update."""
        self._add(request.output_token_ids[self.consumed:], self.counts.device)
        self.consumed = len(request.output_token_ids)


def _counts(request: Request, logits: torch.Tensor) -> TokenCounts:
    state = request.logit_state
    if not isinstance(state, TokenCounts) or state.vocab != logits.shape[-1] or state.counts.device != logits.device:
        state = request.logit_state = TokenCounts(request, logits.shape[-1], logits.device)
    else:
        state.update(request)
    return state


def adjust_row(logits: torch.Tensor, request: Request, eos_token_ids: frozenset[int]) -> None:
    """Apply the module docstring's steps 1-4 to ``logits`` ``[V]`` (float32, modified in place) for
    ``request``'s next token."""
    params = request.sampling_params
    vocab = logits.shape[-1]
    if len(request.output_token_ids) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        masked = [t for t in stops if 0 <= t < vocab]
        if masked:
            kept = logits.clone()
            kept[masked] = float("-inf")
            if bool(torch.isfinite(kept).any()):  # a grammar that allows only a stop token now wins
                logits.copy_(kept)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids, bias)
    if params.repetition_penalty == 1.0 and not params.frequency_penalty and not params.presence_penalty:
        return
    state = _counts(request, logits)
    if params.repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits.copy_(torch.where(state.seen, penalized, logits))
    if params.frequency_penalty or params.presence_penalty:
        logits -= params.frequency_penalty * state.counts + params.presence_penalty * (state.counts > 0).float()


def adjust_logits(logits: torch.Tensor, batch: Sequence[Request],
                  eos_token_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """``logits`` ``[B, V]`` with each row adjusted for ``batch[i]`` (:func:`adjust_row`); the same tensor
    when no request asks for an adjustment, else a float32 copy (``logits`` is left as it was, for the
    log-probabilities: vLLM reports those of the model's own logits by default)."""
    rows = [i for i, r in enumerate(batch) if r.sampling_params.adjusts_logits]
    if not rows:
        return logits
    out = logits.float().clone()
    for i in rows:
        adjust_row(out[i], batch[i], eos_token_ids)
    return out
