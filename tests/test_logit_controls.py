"""Logit adjustments (min_tokens, logit_bias, repetition / frequency / presence penalties) against a reference
written from their published definitions, token by token in plain Python; the same tokens colocated,
disaggregated and after a migration are in tests/test_fault_tolerance.py."""

from __future__ import annotations

import math

import pytest
import torch

from mm_serve import LLM
from mm_serve.runtime.logit_controls import adjust_logits
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampling_params import SamplingParams

VOCAB = 50
EOS = 2


def reference(logits: list[float], prompt: list[int], outputs: list[int], attempt_outputs: int,
              p: SamplingParams, eos: set[int]) -> list[float]:
    """One row as vLLM and OpenAI define the steps: min_tokens masks stop tokens while this attempt has fewer
    outputs; the bias is added; CTRL's repetition penalty over prompt and outputs (divide if positive, else
    multiply); OpenAI's ``mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence`` over the outputs."""
    out = list(logits)
    if attempt_outputs < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            out[t] = -math.inf
    for t, bias in p.logit_bias:
        out[t] += bias
    for t in set(prompt) | set(outputs):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in range(len(out)):
        count = outputs.count(t)
        out[t] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
    return out


def _request(prompt: list[int], outputs: list[int], params: SamplingParams, offset: int = 0) -> Request:
    """A request whose prompt ends with ``offset`` outputs of an earlier attempt (a migrated one)."""
    request = Request("r", prompt + outputs[:offset], params, output_offset=offset)
    for token in outputs[offset:]:
        request.append_output(token, None)
    return request


PARAMS = [
    SamplingParams(max_tokens=64, min_tokens=8, stop_token_ids=(7, 9)),
    SamplingParams(max_tokens=64, logit_bias=((3, 100.0), (4, -100.0), (11, 0.5))),
    SamplingParams(max_tokens=64, repetition_penalty=1.3),
    SamplingParams(max_tokens=64, repetition_penalty=0.7),
    SamplingParams(max_tokens=64, frequency_penalty=0.6, presence_penalty=-0.4),
    SamplingParams(max_tokens=64, min_tokens=5, ignore_eos=True, logit_bias=((2, 1.5),), repetition_penalty=1.2,
                   frequency_penalty=-1.1, presence_penalty=2.0),
]


@pytest.mark.parametrize("params", PARAMS, ids=["min_tokens", "bias", "repetition", "repetition<1", "openai",
                                                "all"])
@pytest.mark.parametrize("offset", [0, 3], ids=["first-attempt", "migrated"])
def test_rows_equal_the_reference(params: SamplingParams, offset: int) -> None:
    """Random logits of both signs, prompts and outputs with repeats; rows adjusted in one batch with an
    unadjusted row, over several steps (the counts kept on the request are brought up to date, not rebuilt)."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    outputs = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    request = _request(prompt, outputs, params, offset)
    plain = Request("q", prompt, SamplingParams(max_tokens=4))
    for step in range(4):
        logits = torch.randn(2, VOCAB, generator=gen) * 3
        got = adjust_logits(logits, [request, plain], frozenset({EOS}))
        want = reference(logits[0].tolist(), prompt, outputs, len(outputs) - offset, params, {EOS})
        assert torch.equal(got[1], logits[1])
        assert torch.allclose(got[0], torch.tensor(want), rtol=0, atol=1e-5, equal_nan=True), step
        token = int(torch.randint(0, VOCAB, (1,), generator=gen))
        request.append_output(token, None)
        outputs.append(token)


def test_a_batch_without_adjustments_is_left_as_it_is() -> None:
    logits = torch.randn(3, VOCAB)
    batch = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(3)]
    assert adjust_logits(logits, batch) is logits


@pytest.mark.parametrize("kwargs,field", [
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
])
def test_out_of_range_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bias_and_min_tokens_steer_the_embedded_model() -> None:
    """On the embedded model (colocated): +100 on a token makes greedy decoding emit only it; min_tokens keeps a
    stop token from ending the output before that many tokens, then it ends it."""
    llm = LLM("embedded", mode="colocated")
    (free,) = llm.generate([{"prompt": "a purple circle and"}], SamplingParams(max_tokens=12, temperature=0.0))
    forced = free.token_ids[0] + 1
    (biased,) = llm.generate([{"prompt": "a purple circle and"}],
                             SamplingParams(max_tokens=6, temperature=0.0, logit_bias=((forced, 100.0),)))
    assert biased.token_ids == [forced] * 6
    stop = free.token_ids[0]  # greedy would stop at once
    (held,) = llm.generate([{"prompt": "a purple circle and"}],
                           SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,), min_tokens=4,
                                          logit_bias=((stop, 30.0),)))
    assert len(held.token_ids) == 5 and stop not in held.token_ids[:4] and held.token_ids[4] == stop
