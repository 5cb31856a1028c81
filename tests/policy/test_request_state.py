"""Front-end RequestState: out-of-order updates, held early updates, stop strings, abort, fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mm_serve.engine.request_state import RequestState
from mm_serve.inputs.input_processor import load_tokenizer
from mm_serve.runtime.detokenizer import IncrementalDetokenizer
from mm_serve.runtime.messages import TokenUpdate


@pytest.fixture(scope="module")
def tokenizer(tiny_llava: Path) -> Any:
    return load_tokenizer(tiny_llava)


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def make_state(tokenizer: Any, stops: tuple[str, ...] = ()) -> RequestState:
    return RequestState("req", 5, IncrementalDetokenizer(tokenizer, stops))


def test_in_order_updates_build_the_text(tokenizer: Any) -> None:
    """Updates in order extend the tokens; take streams each new piece of text once, with the tokens since
    the index it is given and whether the request had finished, read together."""
    ids = encode(tokenizer, "Hello world")
    state = make_state(tokenizer)
    assert state.apply(TokenUpdate("req", 0, ids[:4])) is False
    assert state.token_ids == ids[:4] and state.take(0).text == "Hello" and state.take(0).text == ""
    assert state.apply(TokenUpdate("req", 4, ids[4:], finish_reason="length")) is True
    assert state.finished and state.finish_reason == "length" and state.stop_reason is None
    assert state.text == "Hello world" and state.take(0).text == " world"
    assert len(state.token_times) == 6 and state.first_token_time is not None
    piece = state.take(4)
    assert piece.text == "" and piece.token_ids == ids[4:] and piece.logprobs == [] and piece.finished


def test_out_of_order_updates_are_applied_in_start_index_order(tokenizer: Any) -> None:
    """An update that arrives early is held until the gap before it is filled."""
    ids = encode(tokenizer, "Hello world there")
    state = make_state(tokenizer)
    assert state.apply(TokenUpdate("req", 4, ids[4:6])) is False
    assert state.apply(TokenUpdate("req", 6, ids[6:])) is False
    assert state.token_ids == [] and state.text == "" and state.take(0).text == ""
    assert state.apply(TokenUpdate("req", 0, ids[:4])) is False
    assert state.token_ids == ids and state.text == "Hello world there"
    assert state.take(0).text == "Hello world there" and not state.finished


def test_early_final_update_waits_for_the_gap(tokenizer: Any) -> None:
    """A finishing update that arrives first does not finish the request until it is reached."""
    ids = encode(tokenizer, "Hello world")
    state = make_state(tokenizer)
    final = TokenUpdate("req", 1, ids[1:], logprobs=[{i: -1.0} for i in ids[1:]], finish_reason="stop",
                        stop_reason=2, events={"finished": 9.0})
    assert state.apply(final) is False and not state.finished
    assert state.apply(TokenUpdate("req", 0, ids[:1], logprobs=[{ids[0]: -0.5}], events={"arrived": 1.0})) is True
    assert (state.finish_reason, state.stop_reason) == ("stop", 2)
    assert state.token_ids == ids and state.logprobs == [{i: -0.5 if k == 0 else -1.0} for k, i in enumerate(ids)]
    assert state.events == {"arrived": 1.0, "finished": 9.0}


def test_stop_string_split_across_two_updates(tokenizer: Any) -> None:
    """A stop string spanning two updates finishes with "stop", the string, and the text cut before it."""
    ids = encode(tokenizer, "abc STOP def")
    state = make_state(tokenizer, ("STOP",))
    assert state.apply(TokenUpdate("req", 0, ids[:5])) is False  # "abc S"
    assert state.take(0).text == "ab"  # the last len("STOP") - 1 characters are held: they may start it
    assert state.apply(TokenUpdate("req", 5, ids[5:])) is True  # "TOP def"
    assert (state.finish_reason, state.stop_reason) == ("stop", "STOP")
    assert state.text == "abc " and state.take(0).text == "c " and state.token_ids == ids  # the held rest, up to it
    assert state.apply(TokenUpdate("req", len(ids), [99], finish_reason="length")) is False
    assert state.finish_reason == "stop" and state.token_ids == ids


def test_stop_string_split_across_updates_arriving_out_of_order(tokenizer: Any) -> None:
    """The second half of a stop string arriving first is held, then the stop is found in order."""
    ids = encode(tokenizer, "abc STOP def")
    state = make_state(tokenizer, ("STOP",))
    assert state.apply(TokenUpdate("req", 5, ids[5:], finish_reason="length")) is False
    assert state.apply(TokenUpdate("req", 0, ids[:5])) is True
    assert (state.finish_reason, state.stop_reason, state.text) == ("stop", "STOP", "abc ")
    assert state.take(0).text == "abc "


def test_abort_in_order_finishes_with_abort(tokenizer: Any) -> None:
    """An in-order abort update finishes the request with "abort" and keeps the text so far."""
    ids = encode(tokenizer, "Hello world")
    state = make_state(tokenizer)
    state.apply(TokenUpdate("req", 0, ids[:4]))
    assert state.apply(TokenUpdate("req", 4, [], finish_reason="abort")) is True
    assert (state.finish_reason, state.text, state.token_ids) == ("abort", "Hello", ids[:4])


def test_early_abort_finishes_at_once(tokenizer: Any) -> None:
    """An abort that arrives ahead of a gap finishes immediately; held tokens past the gap are dropped."""
    ids = encode(tokenizer, "Hello world")
    state = make_state(tokenizer)
    state.apply(TokenUpdate("req", 0, ids[:2]))
    state.apply(TokenUpdate("req", 4, ids[4:]))
    assert state.apply(TokenUpdate("req", 6, [], finish_reason="abort")) is True
    assert state.finish_reason == "abort" and state.token_ids == ids[:2] and state.text == "He"
    assert state.apply(TokenUpdate("req", 2, ids[2:4])) is False and state.token_ids == ids[:2]


def test_fail_finishes_with_an_error_once(tokenizer: Any) -> None:
    """fail sets the error and "error"; later updates and a second fail change nothing."""
    state = make_state(tokenizer)
    seen: list[str | None] = []
    state.listener = lambda s: seen.append(s.finish_reason)
    state.apply(TokenUpdate("req", 0, encode(tokenizer, "Hi")))
    state.fail("worker died")
    assert state.finished and state.wait(0) is True
    assert (state.finish_reason, state.error) == ("error", "worker died")
    state.fail("again")
    assert state.apply(TokenUpdate("req", 2, [5], finish_reason="length")) is False
    assert (state.finish_reason, state.error, state.token_ids) == ("error", "worker died", encode(tokenizer, "Hi"))
    assert seen == [None, "error"]
    assert state.snapshot() == {"request_id": "req", "tokens": encode(tokenizer, "Hi"), "text": "Hi",
                                "finish_reason": "error", "error": "worker died"}


def test_wait_times_out_while_running(tokenizer: Any) -> None:
    """wait returns False on timeout until the request finishes."""
    state = make_state(tokenizer)
    assert state.wait(0.01) is False and not state.finished
