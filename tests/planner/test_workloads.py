"""Built-in workloads, the JSONL format and arrival processes (mm_serve.workloads)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from mm_serve.workloads import (
    RequestSpec,
    WorkloadError,
    gamma_arrivals,
    load_jsonl_workload,
    make_workload,
    poisson_arrivals,
    trace_arrivals,
)


def test_chatbot_is_seeded_and_matches_documented_means() -> None:
    wl = make_workload("chatbot", max_context=2048)
    a, b = wl.sample(20_000, seed=3), wl.sample(20_000, seed=3)
    assert a == b
    assert wl.sample(50, seed=4) != a[:50]
    prompts = [r.prompt_tokens for r in a]
    outputs = [r.output_tokens for r in a]
    assert 150 <= statistics.mean(prompts) <= 170  # ShareGPT mean input 161 (vLLM paper)
    assert 325 <= statistics.mean(outputs) <= 355  # ShareGPT mean output 338
    assert statistics.median(prompts) == pytest.approx(100, abs=5)
    assert min(prompts) >= 4 and max(prompts) <= 1024 and max(outputs) <= 1024
    assert all(r.num_images == 0 and r.total_prompt_tokens == r.prompt_tokens for r in a)


def test_chatbot_respects_model_context() -> None:
    rows = make_workload("chatbot", max_context=512).sample(5000, seed=0)
    assert max(r.prompt_tokens + r.output_tokens for r in rows) <= 512
    assert min(r.output_tokens for r in rows) >= 1


def test_image_workloads_take_image_tokens_from_model() -> None:
    llava = make_workload("llava", image_tokens=576).sample(2000, seed=1)
    assert all(r.num_images == 1 and r.image_tokens == 576 for r in llava)
    assert all(r.total_prompt_tokens == r.prompt_tokens + 576 for r in llava)
    assert 20 <= statistics.median(r.prompt_tokens for r in llava) <= 28
    caption = make_workload("caption", image_tokens=729).sample(500, seed=1)
    assert {r.prompt_tokens for r in caption} == {12}
    assert min(r.output_tokens for r in caption) == 20 and max(r.output_tokens for r in caption) == 40
    with pytest.raises(WorkloadError, match="vision tower"):
        make_workload("llava", image_tokens=0)


def _quantile(values: list[int], q: float) -> float:
    return statistics.quantiles(values, n=100)[round(q * 100) - 1]


def test_code_workload_matches_humaneval_lengths() -> None:
    """Medians and p90s of HumanEval's prompts (396 / 775 chars) and solutions (148.5 / 373 chars) at 3.2 chars/token."""
    rows = make_workload("code").sample(20_000, seed=0)
    assert rows == make_workload("code").sample(20_000, seed=0)
    prompts = [r.prompt_tokens for r in rows]
    outputs = [r.output_tokens for r in rows]
    assert statistics.median(prompts) == pytest.approx(396 / 3.2, rel=0.03)
    assert _quantile(prompts, 0.9) == pytest.approx(775 / 3.2, rel=0.05)
    assert statistics.median(outputs) == pytest.approx(148.5 / 3.2, rel=0.05)
    assert _quantile(outputs, 0.9) == pytest.approx(373 / 3.2, rel=0.06)
    assert min(prompts) >= 36 and max(prompts) <= 425 and min(outputs) >= 5 and max(outputs) <= 270
    assert all(r.num_images == 0 for r in rows)


def test_summarization_is_long_prompts_short_outputs_within_context() -> None:
    rows = make_workload("summarization", max_context=4096).sample(20_000, seed=1)
    prompts = [r.prompt_tokens for r in rows]
    outputs = [r.output_tokens for r in rows]
    assert statistics.median(prompts) == pytest.approx(1600, rel=0.03)
    assert 0.75 <= sum(1000 <= p <= 2500 for p in prompts) / len(prompts) <= 0.85
    assert statistics.median(outputs) == pytest.approx(96, rel=0.05)
    assert min(prompts) >= 768 and max(p + o for p, o in zip(prompts, outputs, strict=True)) <= 4096
    assert sum(prompts) > 10 * sum(outputs)  # prefill is the bulk of the work
    short = make_workload("summarization", max_context=2048).sample(5000, seed=1)
    assert max(r.prompt_tokens for r in short) == 2048 - 512  # capped: about half sit at the cap
    assert 0.5 <= sum(r.prompt_tokens == 1536 for r in short) / len(short) <= 0.6
    assert max(r.prompt_tokens + r.output_tokens for r in short) <= 2048
    with pytest.raises(WorkloadError, match="at least 1296 tokens"):
        make_workload("summarization", max_context=1024)


def test_long_multimodal_sends_two_to_four_images_and_a_document() -> None:
    rows = make_workload("long-multimodal", image_tokens=196).sample(5000, seed=2)
    assert {r.num_images for r in rows} == {2, 3, 4}
    assert all(r.image_tokens == 196 for r in rows)
    assert 850 <= statistics.median(r.prompt_tokens for r in rows) <= 1000  # document + question
    assert max(r.total_prompt_tokens + r.output_tokens for r in rows) <= 4096
    assert min(r.output_tokens for r in rows) >= 8 and min(r.prompt_tokens for r in rows) >= 200
    # 576-token images in a 2,048-token context: fewer images, the answer and then the document cut to fit
    big = make_workload("long-multimodal", image_tokens=576, max_context=2048).sample(2000, seed=2)
    assert max(r.num_images for r in big) == 3
    assert max(r.total_prompt_tokens + r.output_tokens for r in big) <= 2048
    assert min(r.prompt_tokens for r in big) >= 200 and min(r.output_tokens for r in big) >= 8
    assert statistics.median(r.output_tokens for r in big) >= 48  # answers are not sacrificed to the document


def test_unknown_workload_names_the_choices() -> None:
    with pytest.raises(WorkloadError, match="chatbot, code, summarization, llava, long-multimodal, caption"):
        make_workload("sharegpt")


def test_jsonl_rows_with_lengths_text_and_images(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt_len": 100, "output_len": 20}),
        "# a comment",
        json.dumps({"prompt": "x" * 41, "output_len": 5, "num_images": 2}),
        "",
    ]))
    wl = load_jsonl_workload(path, image_tokens=576)
    assert wl.rows == (RequestSpec(100, 20), RequestSpec(11, 5, 2, 576))
    assert not wl.is_trace
    drawn = wl.sample(1000, seed=0)
    assert set(drawn) == set(wl.rows)
    assert drawn == wl.sample(1000, seed=0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"output_len": 5}', "needs 'prompt_len' or 'prompt'"),
        ('{"prompt_len": -1, "output_len": 5}', "'prompt_len' must be a non-negative integer"),
        ('{"prompt_len": 3, "output_len": 0}', "'output_len' must be >= 1"),
        ("[1, 2]", "must be a JSON object"),
        ("{not json", "not JSON"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 1, "output_len": 1}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=message) as err:
        load_jsonl_workload(path)
    assert f"{path}:2" in str(err.value)


def test_trace_is_replayed_in_order_and_rescaled(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(
        json.dumps({"prompt_len": 10 + i, "output_len": 2, "timestamp": 2.0 * i}) for i in range(4)))
    wl = load_jsonl_workload(path)
    assert wl.is_trace
    rows = wl.sample(6, seed=9)
    assert [r.prompt_tokens for r in rows] == [10, 11, 12, 13, 10, 11]
    assert [r.arrival_s for r in rows] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert trace_arrivals(rows, rate=1.0) == pytest.approx([0, 1, 2, 3, 4, 5])


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_cv() -> None:
    for cv in (1.0, 2.0):
        times = gamma_arrivals(40_000, rate=5.0, cv=cv, seed=1)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.03)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.06)
    assert poisson_arrivals(100, 2.0, seed=5) == gamma_arrivals(100, 2.0, 1.0, seed=5)
    slow, fast = poisson_arrivals(50, 1.0, seed=2), poisson_arrivals(50, 4.0, seed=2)
    assert fast == pytest.approx([t / 4 for t in slow])
    with pytest.raises(WorkloadError):
        gamma_arrivals(10, rate=1.0, cv=0.0, seed=0)
