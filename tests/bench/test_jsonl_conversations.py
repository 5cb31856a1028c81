"""JSONL workloads with ``conversation_id`` / ``turn``: grouping, ordering, sampling, errors; the planner refuses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.cli.main import main
from mm_serve.workloads import WorkloadError, is_conversational, trace_arrivals
from mm_serve.workloads.jsonl import load_jsonl_workload


def write(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_rows_are_grouped_by_conversation_and_ordered_by_turn(tmp_path: Path) -> None:
    path = write(tmp_path, [
        {"prompt_len": 11, "output_len": 2, "conversation_id": "a", "turn": 1},
        {"prompt_len": 20, "output_len": 3},
        {"prompt_len": 10, "output_len": 2, "conversation_id": "a", "turn": 0, "num_images": 1},
        {"prompt_len": 30, "output_len": 4, "conversation_id": 7},
        {"prompt_len": 31, "output_len": 4, "conversation_id": 7},
        {"prompt_len": 12, "output_len": 2, "conversation_id": "a", "turn": 5},
    ])
    wl = load_jsonl_workload(path, image_tokens=16)
    assert is_conversational(wl) and not wl.is_trace
    assert [(r.conversation_id, r.turn, r.prompt_tokens) for r in wl.rows] == [
        ("a", 0, 10), ("a", 1, 11), ("a", 2, 12), (None, 0, 20), ("7", 0, 30), ("7", 1, 31)]
    assert [(r.num_images, r.image_tokens) for r in wl.rows][:2] == [(1, 16), (0, 0)]


def test_sampling_draws_whole_conversations_with_their_own_ids(tmp_path: Path) -> None:
    path = write(tmp_path, [{"prompt_len": 10 + t, "output_len": 2, "conversation_id": "x"} for t in range(3)]
                 + [{"prompt_len": 5, "output_len": 2}])
    wl = load_jsonl_workload(path)
    rows = wl.sample(7, seed=0)
    assert len(rows) >= 7 and rows == wl.sample(7, seed=0)
    copies: dict[str, list[int]] = {}
    for r in rows:
        if r.conversation_id is not None:
            copies.setdefault(r.conversation_id, []).append(r.turn)
    assert copies and all(turns == [0, 1, 2] for turns in copies.values())
    assert all(cid.startswith("x@") for cid in copies)
    assert rows[-1].conversation_id is None or rows[-1].turn == 2  # ends on a whole conversation


def test_a_trace_of_conversations_keeps_turn_times_and_cycles(tmp_path: Path) -> None:
    path = write(tmp_path, [
        {"prompt_len": 5, "output_len": 2, "conversation_id": "a", "timestamp": 100.0},
        {"prompt_len": 6, "output_len": 2, "conversation_id": "b", "timestamp": 101.0},
        {"prompt_len": 7, "output_len": 2, "conversation_id": "a", "timestamp": 104.0},
    ])
    wl = load_jsonl_workload(path)
    assert wl.is_trace
    assert [(r.conversation_id, r.turn, r.arrival_s) for r in wl.rows] == [("a", 0, 0.0), ("a", 1, 4.0),
                                                                            ("b", 0, 1.0)]
    rows = wl.sample(4, seed=0)  # one pass is 4 s + a mean gap of 2 s
    assert [(r.conversation_id, r.arrival_s) for r in rows] == [("a@0", 0.0), ("a@0", 4.0), ("b@1", 1.0),
                                                                ("a@2", 6.0), ("a@2", 10.0)]
    # rescaled to 1 request/s over the whole span, whatever the grouped order
    assert trace_arrivals(rows, rate=1.0) == pytest.approx([0.0, 1.6, 0.4, 2.4, 4.0])


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt_len": 1, "output_len": 1, "turn": 0}], "'turn' needs a 'conversation_id'"),
    ([{"prompt_len": 1, "output_len": 1, "conversation_id": ["a"]}], "'conversation_id' must be"),
    ([{"prompt_len": 1, "output_len": 1, "conversation_id": ""}], "'conversation_id' must be"),
    ([{"prompt_len": 1, "output_len": 1, "conversation_id": "a", "turn": -1}], "'turn' must be a non-negative"),
    ([{"prompt_len": 1, "output_len": 1, "conversation_id": "a", "turn": 2},
      {"prompt_len": 1, "output_len": 1, "conversation_id": "a", "turn": 2}], "has turn 2 twice"),
    ([{"prompt_len": 1, "output_len": 1, "conversation_id": "a", "turn": 0},
      {"prompt_len": 1, "output_len": 1, "conversation_id": "a"}], "on all of its rows or on none"),
    ([{"prompt_len": 1, "output_len": 1, "conversation_id": "a", "turn": 0, "timestamp": 5},
      {"prompt_len": 1, "output_len": 1, "conversation_id": "a", "turn": 1, "timestamp": 2}],
     "earlier 'timestamp' than the turn before"),
])
def test_conversation_errors(tmp_path: Path, rows: list[dict[str, object]], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_jsonl_workload(write(tmp_path, rows))


def test_plan_refuses_conversational_workloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, [{"prompt_len": 10, "output_len": 2, "conversation_id": "a"}] * 2)
    status = main(["plan", "--model", "embedded", "--workload", str(path), "--slo-ttft", "1", "--slo-tpot", "0.1"])
    assert status == 2
    assert "conversational" in capsys.readouterr().err
    assert main(["plan", "--model", "embedded", "--workload", "multiturn-llava",
                 "--slo-ttft", "1", "--slo-tpot", "0.1"]) == 2
    assert "cannot replay it" in capsys.readouterr().err
