"""Sampling: seeded reproducibility regardless of the batch, filters, stop handling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.runtime.sampler import Sampler, filter_top_k_top_p, make_generator


@pytest.fixture(scope="module")
def llm(tiny_llava: Path) -> LLM:
    return LLM(model=tiny_llava, mode="colocated", num_pages=256)


def test_same_seed_same_tokens_alone_and_in_a_batch_of_eight_others(llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    request = {"prompt": "Tell me a story about"}
    alone = llm.generate(request, params)[0].token_ids
    others = [
        ({"prompt": f"Other prompt number {i} with words"}, SamplingParams(max_tokens=10 + i, temperature=1.0, seed=i))
        for i in range(8)
    ]
    batch = [others[0][0], others[1][0], request] + [r for r, _ in others[2:]]
    batch_params = [others[0][1], others[1][1], params] + [p for _, p in others[2:]]
    together = llm.generate(batch, batch_params)[2].token_ids
    assert together == alone
    assert len(alone) == 24
    different = llm.generate(request, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True))
    assert different[0].token_ids != alone


def test_greedy_ignores_seed(llm: LLM) -> None:
    a = llm.generate({"prompt": "The cat"}, SamplingParams(max_tokens=8, temperature=0.0, seed=1, ignore_eos=True))
    b = llm.generate({"prompt": "The cat"}, SamplingParams(max_tokens=8, temperature=0.0, seed=2, ignore_eos=True))
    assert a[0].token_ids == b[0].token_ids


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_temperature_below_greedy_below_decodes_greedily(llm: LLM, temperature: float) -> None:
    """Logits divided by 1e-40 overflow to inf and every token came out as id 0 (<unk>); under 1e-5
    (vLLM's bound) decoding is greedy, seed or not."""
    greedy = llm.generate({"prompt": "The cat"}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tiny = llm.generate({"prompt": "The cat"}, SamplingParams(max_tokens=8, temperature=temperature, seed=3,
                                                              ignore_eos=True))
    assert tiny[0].token_ids == greedy[0].token_ids and set(greedy[0].token_ids) != {0}


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate({"prompt": "Water boils"}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    topk1 = llm.generate({"prompt": "Water boils"}, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5, ignore_eos=True))
    assert greedy[0].token_ids == topk1[0].token_ids


def test_filter_top_k_and_top_p_exact() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_top_k_top_p(logits, top_k=2, top_p=1.0)
    assert torch.isinf(kept).tolist() == [False, False, True, True]
    kept = filter_top_k_top_p(logits, top_k=0, top_p=0.8)
    assert torch.isinf(kept).tolist() == [False, False, True, True]
    kept = filter_top_k_top_p(logits, top_k=0, top_p=0.81)
    assert torch.isinf(kept).tolist() == [False, False, False, True]
    kept = filter_top_k_top_p(logits, top_k=0, top_p=0.1)
    assert torch.isinf(kept).tolist() == [False, True, True, True]


def test_sampler_frequencies_follow_probabilities() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None, :]
    gen = make_generator(0)
    params = [SamplingParams(temperature=1.0)]
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[Sampler().sample(logits, params, [gen])[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_max_tokens_and_eos_stop(llm: LLM) -> None:
    out = llm.generate({"prompt": "Hello"}, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    first = out.token_ids[2]
    stopped = llm.generate({"prompt": "Hello"}, SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(first,)))[0]
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(first) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == first


def test_stop_string_is_cut(llm: LLM) -> None:
    full = llm.generate({"prompt": "Hello"}, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate({"prompt": "Hello"}, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"n": 0}, "n"), ({"stop": [""]}, "stop"),
    ({"top_k": True}, "top_k"), ({"n": True}, "n"), ({"logprobs": 2.5}, "logprobs"), ({"logprobs": "3"}, "logprobs"),
    ({"seed": 2**70}, "seed"), ({"seed": "abc"}, "seed"), ({"seed": -5}, "seed"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids"), ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop": [1]}, "stop"), ({"max_tokens": 10**30}, "max_tokens"), ({"temperature": None}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop": 5}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids"),  # were TypeErrors (not iterable)
    ({"logit_bias": 5}, "logit_bias"), ({"logit_bias": [(1,)]}, "logit_bias"),
])
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_minus_one_means_off_as_over_http() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x", stop_token_ids=[3, 4]) == SamplingParams(stop=("x",), stop_token_ids=(3, 4))


def test_a_request_a_worker_cannot_decode_fails_instead_of_hanging(tmp_path: Path) -> None:
    import msgspec

    from mm_serve.runtime import messages
    from tests.factories import front_end_channel

    with front_end_channel(tmp_path, messages.ToPrefill) as (channel, control, output):
        bad = {"type": "PrefillRequest", "request_id": "r-7", "prompt_token_ids": [1, 2], "sampling": "nonsense"}
        control.send(msgspec.msgpack.encode(bad))
        control.send(messages.encode(messages.StatsQuery()))
        got: list[object] = []
        for _ in range(50):
            got += channel.recv(100)
            if got:
                break
        assert [type(m).__name__ for m in got] == ["StatsQuery"]  # the bad one is dropped, the next one served
        assert output.poll(2000)
        failed = messages.decoder(messages.FromWorker).decode(output.recv())
        assert isinstance(failed, messages.RequestFailed) and failed.request_id == "r-7"
        assert "could not decode" in failed.message


def test_seed_leaves_room_for_every_choice() -> None:
    """Choice i of n draws with seed + i: a seed too close to MAX_SEED for n is refused at once,
    naming the bound, not later inside generate."""
    from mm_serve.runtime.sampling_params import MAX_SEED

    assert SamplingParams(seed=MAX_SEED, n=1).seed == MAX_SEED
    assert SamplingParams(seed=MAX_SEED - 3, n=4).n == 4
    with pytest.raises(ValueError, match=f"seed must be at most {MAX_SEED - 3} with n = 4"):
        SamplingParams(seed=MAX_SEED - 2, n=4)


def test_the_batched_draw_picks_what_torch_multinomial_picks_row_by_row() -> None:
    """Sampler.sample draws every sampled row's exponential noise from its own generator and takes one
    argmax over the batch: the tokens equal ``torch.multinomial(softmax(filtered / T), 1, generator)`` row by
    row (the draw it replaced), over 300 batches of mixed greedy, temperature, top-k and top-p rows."""
    sampler = Sampler()
    rng = torch.Generator().manual_seed(7)
    for batch in range(300):
        rows = 1 + batch % 9
        logits = torch.randn(rows, 691, generator=rng) * 4
        params = [SamplingParams(max_tokens=4, temperature=[0.0, 0.7, 1.0, 1.6][(batch + r) % 4],
                                 top_k=[0, 5, 50][(batch + 2 * r) % 3], top_p=[1.0, 0.9, 0.3][(batch + r) % 3])
                  for r in range(rows)]
        seeds = [batch * 31 + r for r in range(rows)]
        got = sampler.sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
        want = []
        for r, p in enumerate(params):
            if p.greedy:
                want.append(int(torch.argmax(logits[r])))
                continue
            probs = torch.softmax(filter_top_k_top_p(logits[r] / p.temperature, p.top_k, p.top_p), dim=-1)
            want.append(int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seeds[r])).item()))
        assert got == want, batch
