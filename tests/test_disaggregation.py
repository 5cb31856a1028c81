"""Disaggregated prefill/decode: same tokens as transformers and colocated, preemption, cleanup."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.ground.tiers import Tier
from tests.factories import gradient_image, image_in_mode
from tests.golden import load_reference, reference_generate

Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
Q2 = "USER: <image>\nCompare this <image>\nwith the first one. ASSISTANT:"
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

CASES: list[dict[str, Any]] = [
    {"prompt": "Serving a language model means"},
    {"prompt_token_ids": [7]},
    {"prompt": Q, "images": [gradient_image(80, 60, 1)]},
    {"prompt": Q2, "images": [gradient_image(200, 90, 2), gradient_image(33, 120, 3)]},
    {"prompt": Q, "images": [gradient_image(5, 3, 4)]},
    {"prompt": Q, "images": [gradient_image(1, 400, 5)]},
    {"prompt": " ".join(["The quick brown fox jumps over the lazy dog."] * 25)},
    {"prompt": Q, "images": [image_in_mode("RGBA", 70, 50, 9)]},
    {"prompt": Q, "images": [image_in_mode("P", 70, 50, 10)]},
    {"prompt": Q, "images": [image_in_mode("I;16", 70, 50, 11)]},
    {"prompt": Q, "images": [image_in_mode("CMYK", 70, 50, 12)]},
    {"messages": [{"role": "user", "content": [
        {"type": "image", "image": gradient_image(64, 64, 6)}, {"type": "text", "text": "Describe the image."}]}]},
]


def shm_segments(prefix: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


@pytest.fixture(scope="module")
def reference_tokens(tiny_llava: Path) -> list[list[int]]:
    colocated = LLM(model=tiny_llava, mode="colocated")
    reference = load_reference(tiny_llava, multimodal=True)
    return [reference_generate(reference, colocated.inputs.process(r), 32)[0] for r in CASES]


@pytest.fixture(scope="module")
def one_p_one_d(tiny_llava: Path) -> Iterator[LLM]:
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512) as llm:
        yield llm


def test_1p1d_without_a_compiler_runs_the_torch_kernels(
    tiny_llava: Path, reference_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The front end builds the CPU kernels before the workers start; where that fails, it
    says so once on its own stderr and the workers run the torch path, still exact."""
    monkeypatch.setenv("MM_SERVE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512) as llm:
        assert llm.client is not None
        assert {s.sizing.cpu_kernels for s in llm.client.pool.specs} == {"torch"}
        outputs = llm.generate(CASES, GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens
    err = capfd.readouterr().err
    assert err.count("compiled CPU kernels unavailable") == 1 and "'no-such-compiler-here' is not on PATH" in err


def test_a_hung_kernel_build_times_out_to_the_torch_kernels(
    tiny_llava: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str],
) -> None:
    """A compiler that never returns does not keep the workers from starting."""
    import mm_serve.cluster.kernel_prebuild as kernel_prebuild

    hung = tmp_path / "hung-cxx"
    hung.write_text("#!/bin/sh\nexec sleep 1000\n")
    hung.chmod(0o755)
    monkeypatch.setenv("MM_SERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(hung))
    monkeypatch.setattr(kernel_prebuild, "CPU_KERNEL_BUILD_TIMEOUT_S", 3.0)
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512) as llm:
        assert llm.client is not None
        assert {s.sizing.cpu_kernels for s in llm.client.pool.specs} == {"torch"}
        assert len(llm.generate(CASES[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert "building the CPU kernels took over 3 s" in capfd.readouterr().err


def test_colocated_equals_transformers(tiny_llava: Path, reference_tokens: list[list[int]]) -> None:
    outputs = LLM(model=tiny_llava, mode="colocated").generate(CASES, GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens


def test_1p1d_equals_transformers(one_p_one_d: LLM, reference_tokens: list[list[int]]) -> None:
    outputs = one_p_one_d.generate(CASES, GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens
    assert [o.finish_reason for o in outputs] == ["length"] * len(CASES)


def test_the_prefill_worker_reports_the_batches_it_starts(one_p_one_d: LLM) -> None:
    """Each prefill batch's start reaches the front end (``PrefillStarted``): the load view then
    counts the batch in progress apart from the queue (``running``; empty once its first tokens
    came back), which only a worker that reports its batches has."""
    client = one_p_one_d.client
    assert client is not None
    one_p_one_d.generate({"prompt": Q, "images": [gradient_image(40, 40)]}, GREEDY)
    view = client.load_view(1, 10, 4)
    assert view is not None and view.running is not None
    assert (view.running.requests, view.running_elapsed_s) == (0, 0.0) and view.ahead.requests == 0
    assert view.recent.requests >= 1  # the request just sent counts in the worker's arrival rate


def test_an_image_its_prefill_worker_has_encoded_is_not_priced_again(one_p_one_d: LLM) -> None:
    """After a request with an image, a new prompt with the same image (its prefix not cached:
    the image comes after different text) is believed to need no encode on that worker (its
    encoder cache holds the image), while a new image does; the admission predictor leaves
    the former out of the request's own prefill."""
    client = one_p_one_d.client
    assert client is not None
    image = gradient_image(48, 40)
    one_p_one_d.generate({"prompt": Q, "images": [image]}, GREEDY)
    for picture, expected in ((image, 1), (gradient_image(40, 48), 0)):
        inputs = client.inputs.process({"prompt": "USER: Look closely. <image>\nWhat is it? ASSISTANT:",
                                        "images": [picture]})
        view = client.load_view(1, len(inputs.prompt_token_ids), 4, inputs)
        assert view is not None and view.cached_tokens == 0 and view.cached_images == expected


def test_2p1d_equals_transformers_and_repeats_go_where_their_prefix_is(
    tiny_llava: Path, reference_tokens: list[list[int]],
) -> None:
    """Two prefill workers share the first round; in the second every request goes back to the
    worker that holds its prefix (cache-aware routing), so each reuses every full page but the
    last token's and no image is encoded again; outputs equal transformers both times."""
    with LLM(model=tiny_llava, mode="disaggregated", prefill_workers=2, decode_workers=1, num_pages=512) as llm:
        outputs = llm.generate(CASES, GREEDY)
        stats = llm.client.query_stats() if llm.client else {}
        repeat = llm.generate(CASES, GREEDY)
        after = llm.client.query_stats() if llm.client else {}
    assert [o.token_ids for o in outputs] == reference_tokens
    assert [o.token_ids for o in repeat] == reference_tokens
    encoded = [stats[("prefill", i)].num_encoded_images for i in range(2)]
    assert sum(encoded) == sum(len(c.get("images", [])) + (1 if "messages" in c else 0) for c in CASES)
    assert all(n > 0 for n in encoded), f"router used one prefill worker only: {encoded}"
    assert [after[("prefill", i)].num_encoded_images for i in range(2)] == encoded  # every image from the cache
    assert [o.num_cached_tokens for o in repeat] == [(o.num_prompt_tokens - 1) // 16 * 16 for o in repeat]
    assert all(o.num_cached_tokens == 0 for o in outputs)


def test_colocated_worker_process_equals_transformers(tiny_llava: Path, reference_tokens: list[list[int]]) -> None:
    with LLM(model=tiny_llava, mode="colocated-worker", num_pages=512) as llm:
        outputs = llm.generate(CASES[:6], GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens[:6]


def test_prefill_and_decode_run_in_different_processes(one_p_one_d: LLM) -> None:
    one_p_one_d.generate({"prompt": Q, "images": [gradient_image(40, 40)]}, GREEDY)
    assert one_p_one_d.client is not None
    stats = one_p_one_d.client.query_stats()
    prefill, decode = stats[("prefill", 0)], stats[("decode", 0)]
    assert len({prefill.pid, decode.pid, os.getpid()}) == 3
    assert prefill.num_encoded_images >= 1 and decode.num_encoded_images == 0
    # compute.worker_nice (5): the workers yield the cores to the front end when both want them
    assert [niceness(p) for p in (prefill.pid, decode.pid)] == [niceness(os.getpid()) + 5] * 2


def niceness(pid: int) -> int:
    """The nice value of process ``pid`` (Linux /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_workers_sleep_until_woken(one_p_one_d: LLM) -> None:
    """Idle workers wait on their sockets (the decode worker on its hand-off doorbell
    too) instead of polling: a 1 ms poll of the ring cost 2-6 % of a core."""
    assert one_p_one_d.client is not None
    stats = one_p_one_d.client.query_stats()
    pids = [stats[("prefill", 0)].pid, stats[("decode", 0)].pid]
    time.sleep(0.5)  # past any spin-wait of the last request's compute threads
    before = [cpu_seconds(p) for p in pids]
    time.sleep(2.0)
    used = [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
    assert all(u <= 0.06 for u in used), used  # <= 3 % of a core each over 2 s
    # and a request still goes straight through: the doorbell wakes the decode worker
    start = time.monotonic()
    out = one_p_one_d.generate({"prompt": "Tell me about the number 3"}, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and time.monotonic() - start < 10.0


def test_seeded_sampling_matches_colocated(tiny_llava: Path, one_p_one_d: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    request = {"prompt": Q, "images": [gradient_image(50, 50, 3)]}
    colocated = LLM(model=tiny_llava, mode="colocated").generate(request, params)[0].token_ids
    assert one_p_one_d.generate(request, params)[0].token_ids == colocated


def test_preemption_recomputes_without_reencoding(tiny_llava: Path) -> None:
    """A tiny decode page pool forces preemption; outputs stay identical and no image is re-encoded.

    Each request is 46 prompt + 60 output tokens = 27 pages of 4: one fits the 40 pages, any two
    decoding at once outgrow it. Six of them (not four with 40 tokens each, which on a loaded
    machine were once prefilled so far apart that each decode had finished before the next hand-off)."""
    requests = [{"prompt": Q, "images": [gradient_image(60 + i, 40, i)]} for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=tiny_llava, mode="colocated").generate(requests, params)]
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=40, page_size=4, ring_pages=20) as llm:
        outputs = llm.generate(requests, params)
        assert llm.client is not None
        stats = llm.client.query_stats()
    assert [o.token_ids for o in outputs] == expected
    assert stats[("decode", 0)].num_preemptions > 0
    assert stats[("prefill", 0)].num_encoded_images == 6
    assert stats[("decode", 0)].num_encoded_images == 0


def test_200_mixed_requests_free_every_page_and_clean_up(tiny_llava: Path) -> None:
    requests: list[dict[str, Any]] = []
    for i in range(200):
        kind = i % 3
        if kind == 0:
            requests.append({"prompt": f"Request {i}: tell me about the number {i}"})
        elif kind == 1:
            requests.append({"prompt": Q, "images": [gradient_image(30 + i % 50, 40, i)]})
        else:
            requests.append({"prompt": Q2, "images": [gradient_image(20, 20, i), gradient_image(45, 30, i + 1)]})
    params = [SamplingParams(max_tokens=4 + i % 13, temperature=0.0 if i % 2 else 0.7, seed=i) for i in range(200)]
    llm = LLM(model=tiny_llava, mode="disaggregated", num_pages=256, ring_buffer_size=4)
    assert llm.client is not None
    prefix = f"mmsrv-{llm.client.pool.instance}"
    pids = [p.pid for p in llm.client.pool.processes]
    try:
        outputs = llm.generate(requests, params)
        assert all(1 <= len(o.token_ids) <= 4 + i % 13 for i, o in enumerate(outputs))
        assert all(o.finish_reason in ("stop", "length") for o in outputs)
        stats = llm.client.query_stats()
        for key in (("prefill", 0), ("decode", 0)):
            assert stats[key].kv_pages_used == 0, key
            assert stats[key].pages_integrity_ok, key
            assert stats[key].ring_slots_used == 0, key
        assert shm_segments(prefix), "rings should exist while serving"
    finally:
        llm.close()
    assert shm_segments(prefix) == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_worker_processes_reject_bad_mode(tiny_llava: Path) -> None:
    with pytest.raises(ValueError, match="mode must be"):
        LLM(model=tiny_llava, mode="sideways")
    with pytest.raises(ValueError, match="unknown LLM arguments"):
        LLM(model=tiny_llava, mode="disaggregated", bogus=1)
    assert torch.get_num_threads() >= 1


def test_chunked_prefill_equals_transformers(tiny_llava: Path, reference_tokens: list[list[int]]) -> None:
    """Chunks of 24 tokens: images (16 tokens each) and the ~300-token prompt straddle chunk ends;
    each later chunk attends to the KV of the earlier ones. Run twice, so the second round's
    chunks start after a prefix-cache hit."""
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512, prefill_chunk_tokens=24) as llm:
        first = llm.generate(CASES, GREEDY)
        again = llm.generate(CASES, GREEDY)
        assert llm.client is not None
        stats = llm.client.query_stats()
    assert [o.token_ids for o in first] == reference_tokens
    assert [o.token_ids for o in again] == reference_tokens
    assert any(o.num_cached_tokens >= 48 for o in again)
    assert stats[("prefill", 0)].kv_pages_used == 0 and stats[("prefill", 0)].pages_integrity_ok


def test_prompt_logprobs_over_chunks_and_images_equal_transformers(tiny_llava: Path) -> None:
    """``prompt_logprobs`` of image prompts prefilled in chunks of 24 (images straddle chunk ends), with
    their pages cached by an earlier call: every prompt token's log-probability after the first equals
    transformers' log-softmax of the logits at the position before (1e-4), with the 3 best; colocated
    in-process gives the same; the outputs are those without the field."""
    import dataclasses

    params = dataclasses.replace(GREEDY, max_tokens=2, prompt_logprobs=3)
    cases = [CASES[0], CASES[2], CASES[3]]
    reference = load_reference(tiny_llava, multimodal=True)
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512, prefill_chunk_tokens=24) as llm:
        plain = llm.generate(cases, dataclasses.replace(GREEDY, max_tokens=2))
        outs = llm.generate(cases, params)
        processed = [llm.inputs.process(case) for case in cases]
    colocated = LLM(model=tiny_llava, mode="colocated").generate(cases, params)
    for out, alone, same, inputs in zip(outs, plain, colocated, processed, strict=True):
        assert out.token_ids == alone.token_ids and out.num_cached_tokens == 0
        ids = inputs.prompt_token_ids
        with torch.inference_mode():
            kwargs = {} if inputs.pixel_values is None else {"pixel_values": inputs.pixel_values}
            logp = torch.log_softmax(reference(input_ids=torch.tensor([ids]), **kwargs).logits[0].float(), -1)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None
        assert [entry[ids[p]] for p, entry in enumerate(got) if entry] == pytest.approx(
            [float(logp[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4)
        best = torch.topk(logp[:-1], 3).indices.tolist()
        assert all(set(best[p - 1]) <= set(got[p]) for p in range(1, len(ids)))  # type: ignore[arg-type]
        assert same.prompt_logprobs is not None and [sorted(e) for e in same.prompt_logprobs[1:]] == \
            [sorted(e) for e in got[1:]]  # type: ignore[union-attr]


def test_paced_decode_steps_keep_their_interval_free_the_core_and_the_tokens(
    tiny_llava: Path, reference_tokens: list[list[int]],
) -> None:
    """``decode_step_interval_ms``: decode steps begin at least 60 ms apart, the decode worker
    sleeps between them (its CPU time is a small part of the run), and greedy outputs are the
    same as transformers'. Unpaced, the tiny model's 31 decode steps take well under 0.5 s."""
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512, decode_step_interval_ms=60,
             decode_pacing_always=True) as llm:
        assert llm.client is not None
        decode_pid = llm.client.query_stats()[("decode", 0)].pid
        cpu_before, start = cpu_seconds(decode_pid), time.monotonic()
        outputs = llm.generate(CASES[:3], GREEDY)  # 32 tokens each: the first from prefill, 31 decode steps
        elapsed, cpu = time.monotonic() - start, cpu_seconds(decode_pid) - cpu_before
    assert [o.token_ids for o in outputs] == reference_tokens[:3]
    assert elapsed >= 31 * 0.060
    assert cpu < 0.5 * elapsed, (cpu, elapsed)


def test_decode_pacing_follows_the_tightest_tpot_slo_among_running_requests(tiny_llava: Path) -> None:
    """``decode_step_pacing`` 0.5: a standard-tier request alone (TPOT SLO 250 ms) gets a decode step
    every 125 ms at the soonest; an interactive one (100 ms) every 50 ms, and a standard one running
    beside it is paced at the interactive rate too (the tightest SLO among the running requests). The
    steps the worker reports to the admission predictor leave the pacing sleep out (the tiny model's
    step is milliseconds: the predictor adds the interval itself)."""
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)  # 8 decode steps, 7 paced intervals
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512, decode_step_pacing=0.5,
             decode_pacing_always=True) as llm:
        client = llm.client
        assert client is not None
        reported: list[float] = []
        client.step_listeners.append(
            lambda role, index, timing: reported.append(timing.seconds) if timing.kind == "decode" else None)

        def decode_seconds(tiers: list[Tier]) -> float:
            states = [client.submit(f"paced-{tier.label}-{time.monotonic_ns()}",
                                    llm.inputs.process({"prompt_token_ids": list(range(5, 25))}), params, tier=tier)
                      for tier in tiers]
            for state in states:
                state.wait()
            assert all(len(s.token_ids) == 9 for s in states)
            return max(s.token_times[-1] - s.token_times[0] for s in states)  # the first token comes from prefill

        standard = decode_seconds([Tier.STANDARD])
        interactive = decode_seconds([Tier.INTERACTIVE])
        both = decode_seconds([Tier.INTERACTIVE, Tier.STANDARD])
    assert standard >= 7 * 0.125, standard
    assert 7 * 0.05 <= interactive < 7 * 0.1, interactive
    assert 7 * 0.05 <= both < 7 * 0.1, both
    assert len(reported) >= 20  # 8 decode steps a run (the two requests of the last share theirs)
    assert statistics.median(reported) < 0.025, sorted(reported)  # half the tightest interval (50 ms)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a prefill and a decode core")
def test_a_decode_worker_paces_only_while_another_process_wants_its_core(
    tiny_llava: Path, reference_tokens: list[list[int]],
) -> None:
    """``decode_step_interval_ms`` 60 without ``decode_pacing_always``: alone on its core the decode
    worker steps at once (31 steps well under 31 x 60 ms); with a busy loop at nice 10 pinned to the
    same core (a prefill worker sharing it), its steps begin 60 ms apart again. Outputs stay exact."""
    import subprocess
    import sys

    prefill_core, decode_core = sorted(os.sched_getaffinity(0))[:2]
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512, decode_step_interval_ms=60,
             prefill_cpus=[prefill_core], decode_cpus=[decode_core]) as llm:
        start = time.monotonic()
        alone = llm.generate(CASES[:3], GREEDY)  # 31 decode steps each, batched together
        alone_s = time.monotonic() - start
        loop = (f"import os, time\nos.sched_setaffinity(0, {{{decode_core}}})\nos.nice(10)\n"
                "end = time.monotonic() + 60\nwhile time.monotonic() < end: pass")
        neighbour = subprocess.Popen([sys.executable, "-c", loop])
        try:
            time.sleep(0.5)  # the decode worker's next window sees it
            start = time.monotonic()
            shared = llm.generate(CASES[:3], GREEDY)
            shared_s = time.monotonic() - start
        finally:
            neighbour.kill()
            neighbour.wait()
    assert [o.token_ids for o in alone] == [o.token_ids for o in shared] == reference_tokens[:3]
    assert alone_s < 31 * 0.060 * 0.8, alone_s  # unpaced: ~0.2 s (the front end may land on the core now and then)
    assert shared_s >= 30 * 0.060, shared_s  # the first step after a hand-off may start at once


@pytest.mark.parametrize("chunk", [0, 64])
def test_a_short_request_behind_a_long_prompt_waits_for_one_chunk(tiny_llava: Path, chunk: int) -> None:
    """A 2000-token prompt, then at once a 10-token one (same tier). Unsplit, the short one's first
    token comes after the long one's (it runs alone, a bucket of its own); in chunks of 64 the short
    one joins the first chunks and is answered long before the long prompt is prefilled."""
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=512, prefill_chunk_tokens=chunk) as llm:
        assert llm.client is not None
        long_inputs = llm.inputs.process({"prompt_token_ids": [(i * 7) % 400 + 5 for i in range(2000)]})
        short_inputs = llm.inputs.process({"prompt_token_ids": list(range(5, 15))})
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        long_state = llm.client.submit(f"long-{chunk}", long_inputs, params)
        short_state = llm.client.submit(f"short-{chunk}", short_inputs, params)
        for state in (long_state, short_state):
            state.wait()
    assert long_state.first_token_time is not None and short_state.first_token_time is not None
    if chunk:
        assert short_state.first_token_time < long_state.first_token_time
    else:
        assert short_state.first_token_time > long_state.first_token_time
