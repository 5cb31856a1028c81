"""A conversational run against the fake server with a prefix cache: closed-loop turns with their
history, TTFT per turn, the cached-token hit rate and the server's /metrics counters."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from mm_serve.bench.client import EARLIER_TURN_FAILED, Endpoint, run_load
from mm_serve.bench.requests import RequestFactory
from mm_serve.bench.runner import LoadRunner, LoadSpec
from mm_serve.bench.server_metrics import (
    ENCODER_HITS,
    ENCODER_MISSES,
    PREFIX_HITS,
    PREFIX_QUERIED,
    parse_counters,
    scrape,
)
from mm_serve.cli.main import main
from mm_serve.ground.slo import SLO
from mm_serve.workloads.shared_content import MultiturnLlavaWorkload
from tests.bench.fake_server import FakeServer

# Turn k (1-based) sends 2k - 1 messages of 10 tokens; the previous turn's 2k - 3 are cached:
# per conversation 10 * (1 + 3 + 5 + 7 + 9) = 250 prompt tokens, 10 * (0 + 1 + 3 + 5 + 7) = 160 cached.
PROMPT, CACHED = 250, 160


def test_multiturn_run_reports_turns_and_cache_hits() -> None:
    factory = RequestFactory("fake-model", image_size=16)
    load = LoadSpec(MultiturnLlavaWorkload(image_tokens=16, max_context=4096), seed=0, num_requests=10)
    with FakeServer(service_s=0.3, prefix_cache=True) as server:
        runner = LoadRunner(Endpoint(server.url), factory, load, SLO(5.0, 1.0), target=0.9)
        run = runner.run_at(4.0)
        bodies = server.app.state.bodies
    assert run.num_requests == 10 and run.num_ok == 10, run.errors
    assert set(run.ttft_by_turn) == {"1", "2", "3", "4", "5", "2+"}
    assert [run.ttft_by_turn[k].count for k in ("1", "2", "5", "2+")] == [2, 2, 2, 8]
    # turn 1 waits the whole 0.3 s; turn k >= 2 waits 0.3 * 2 / (2k - 1) <= 0.2 s
    assert run.ttft_by_turn["1"].p50 >= 0.3 > run.ttft_by_turn["2+"].p50 + 0.05
    assert (run.cache.prompt_tokens, run.cache.cached_tokens, run.cache.requests) == (2 * PROMPT, 2 * CACHED, 10)
    assert run.cache.hit_rate == pytest.approx(0.64)
    assert run.server_counters == {PREFIX_QUERIED: 2 * PROMPT, PREFIX_HITS: 2 * CACHED,
                                   ENCODER_HITS: 8.0, ENCODER_MISSES: 2.0}
    # every turn was sent after the previous answer, with it as the assistant message
    by_conversation: dict[str, list[dict[str, object]]] = {}
    for body in bodies:
        first = json.dumps(body["messages"][0])
        by_conversation.setdefault(first, []).append(body)
    assert sorted(len(turns) for turns in by_conversation.values()) == [5, 5]
    for turns in by_conversation.values():
        for k, body in enumerate(turns):
            messages = body["messages"]
            assert isinstance(messages, list) and len(messages) == 2 * k + 1
            if k:
                expected = "a" + " b" * (int(str(turns[k - 1]["max_tokens"])) - 1)
                assert messages[-2] == {"role": "assistant", "content": expected}


def test_cli_prints_per_turn_ttft_and_hit_rates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "chat.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": 8, "output_len": 3, "conversation_id": "c"}) + "\n"
                             for _ in range(5)))
    with FakeServer(service_s=0.05, prefix_cache=True) as server:
        status = main(["bench", "--server", server.url, "--workload", str(trace), "--rate", "5",
                       "--slo-ttft", "2", "--slo-tpot", "1", "--num-requests", "10", "--out", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "TTFT p50 / p90 (s) by turn: turn 1 " in out and ", turns 2+ " in out and ", turn 5 " in out
    assert "prompt-cache hit rate 64.0 % (cached_tokens 320 of 500 prompt tokens, 10 responses)" in out
    assert "server /metrics: prefix-cache hit rate 64.0 % (tokens), encoder-cache hit rate - % of 0 images" in out
    (system,) = json.loads((tmp_path / "bench.json").read_text())["systems"]
    single = system["single"]
    assert single["cache"] == {"prompt_tokens": 500, "cached_tokens": 320, "requests": 10}
    assert single["ttft_by_turn"]["2+"]["count"] == 8
    rows = [json.loads(line) for line in (tmp_path / "records-server.jsonl").read_text().splitlines()]
    assert sorted(r["turn"] for r in rows if r["rate"] == 5.0) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_turns_wait_for_the_previous_answer_and_stop_after_a_failure() -> None:
    factory = RequestFactory("fake-model", image_size=16)
    specs = MultiturnLlavaWorkload(image_tokens=16).sample(10, seed=0)
    plan = factory.plan(specs, [0.0] * 10)  # both conversations start at once
    with FakeServer(service_s=0.05) as server:
        ok = asyncio.run(run_load(Endpoint(server.url), plan)).records
    for conversation in (ok[:5], ok[5:]):
        for before, after in zip(conversation, conversation[1:], strict=False):
            assert before.end_s is not None and after.sent_s is not None and after.sent_s >= before.end_s
    with FakeServer(service_s=0.0, status=503) as server:
        failed = asyncio.run(run_load(Endpoint(server.url), plan)).records
        assert len(server.app.state.bodies) == 2  # one first turn per conversation, nothing after it
    assert [r.error is not None and r.error.startswith("HTTP 503") for r in failed] == [True, False, False, False,
                                                                                         False] * 2
    assert [r.error for r in failed if r.turn] == [EARLIER_TURN_FAILED] * 8
    assert all(r.sent_s is None for r in failed if r.turn)


def test_a_plain_server_has_no_cache_figures() -> None:
    with FakeServer(service_s=0.0) as server:
        assert scrape(server.url) == {}
        runner = LoadRunner(Endpoint(server.url), RequestFactory("fake-model"),
                            LoadSpec(MultiturnLlavaWorkload(image_tokens=16), num_requests=5), SLO(5.0, 1.0), 0.9)
        run = runner.run_at(5.0)
    assert run.num_ok == 5 and run.server_counters == {} and run.cache.requests == 0
    assert math.isnan(run.cache.hit_rate) and run.ttft_by_turn["1"].count == 1


def test_prometheus_counters_are_summed_over_labels() -> None:
    text = "\n".join([
        "# HELP mm_serve_prefix_cache_hit_tokens_total tokens",
        'mm_serve_prefix_cache_hit_tokens_total{worker="0"} 12.0',
        'mm_serve_prefix_cache_hit_tokens_total{worker="1",x="a}b"} 30',
        "mm_serve_encoder_cache_hits_total 4 1700000000000",
        "mm_serve_encoder_cache_hits_created 1.7e9",
        "other_total 9",
        "mm_serve_encoder_cache_misses_total NaN",
    ])
    assert parse_counters(text) == {PREFIX_HITS: 42.0, ENCODER_HITS: 4.0}
