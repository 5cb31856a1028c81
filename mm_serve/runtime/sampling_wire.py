"""Convert :class:`SamplingParams` to and from :class:`~mm_serve.runtime.messages.SamplingMsg`."""

from __future__ import annotations

from mm_serve.runtime.messages import SamplingMsg
from mm_serve.runtime.sampling_params import SamplingParams


def to_wire(params: SamplingParams, eos_token_ids: frozenset[int]) -> SamplingMsg:
    """Wire form; EOS ids are folded into ``stop_token_ids`` unless ``ignore_eos``.

    Workers then need no tokenizer: every token-level stop is in ``stop_token_ids``.
    """
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= eos_token_ids
    return SamplingMsg(
        max_tokens=params.max_tokens, temperature=float(params.temperature), top_p=float(params.top_p),
        top_k=params.top_k, seed=params.seed, stop_token_ids=sorted(stops), ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, min_tokens=params.min_tokens, logit_bias=list(params.logit_bias),
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, structured=params.structured,
        prompt_logprobs=params.prompt_logprobs,
    )


def from_wire(msg: SamplingMsg) -> SamplingParams:
    """Worker-side params: EOS is already in ``stop_token_ids``, so ``ignore_eos`` is set."""
    return SamplingParams(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        seed=msg.seed, stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=True, logprobs=msg.logprobs,
        min_tokens=msg.min_tokens, logit_bias=tuple((int(t), float(v)) for t, v in msg.logit_bias),
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty,
        structured=None if msg.structured is None else (msg.structured[0], msg.structured[1]),
        prompt_logprobs=msg.prompt_logprobs,
    )
