"""post_step: stop checks and their order, process_step's finish hand-over, token_update's deltas."""

from __future__ import annotations

import pytest

from mm_serve.runtime.lifetime import LifetimeEvent
from mm_serve.runtime.post_step import StopCriteria, check_stop, process_step, token_update
from mm_serve.runtime.request import Request, RequestStatus
from tests.policy.factories import make_request, make_scheduler

EOS = 2
CRITERIA = StopCriteria(eos_token_ids=frozenset({EOS}), max_model_len=64)


class TokenStopMatcher:
    """A stand-in for the detokenizer: the stop string "END" appears when token ``trigger`` is added."""

    def __init__(self, trigger: int) -> None:
        self.trigger = trigger
        self.seen: list[int] = []
        self._stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stop is not None

    @property
    def stop_string(self) -> str | None:
        return self._stop

    def add(self, token_ids: list[int]) -> str:
        self.seen.extend(token_ids)
        if self.trigger in token_ids:
            self._stop = "END"
        return ""


def step(request: Request, token: int, criteria: StopCriteria = CRITERIA) -> RequestStatus | None:
    """Append ``token`` and check, as process_step does."""
    request.append_output(token, None)
    return check_stop(request, token, criteria)


def test_eos_stops_unless_ignore_eos() -> None:
    """EOS finishes STOPPED with the token as stop_reason; with ignore_eos it is an ordinary token."""
    request = make_request("a", 4)
    assert step(request, 5) is None and request.stop_reason is None
    assert step(request, EOS) is RequestStatus.FINISHED_STOPPED and request.stop_reason == EOS
    ignoring = make_request("b", 4, ignore_eos=True)
    assert step(ignoring, EOS) is None and ignoring.stop_reason is None


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    """A request's own stop_token_ids finish it whatever ignore_eos says."""
    request = make_request("a", 4, stop_token_ids=(7, 9), ignore_eos=True)
    assert step(request, 8) is None
    assert step(request, 9) is RequestStatus.FINISHED_STOPPED and request.stop_reason == 9


def test_max_tokens_finishes_with_length() -> None:
    """The max_tokens-th output finishes the request FINISHED_LENGTH with no stop_reason."""
    request = make_request("a", 4, max_tokens=3)
    assert [step(request, t) for t in (5, 6, 7)] == [None, None, RequestStatus.FINISHED_LENGTH]
    assert request.stop_reason is None


def test_context_limit_finishes_with_length() -> None:
    """Reaching max_model_len tokens (prompt + outputs) finishes the request FINISHED_LENGTH."""
    criteria = StopCriteria(frozenset({EOS}), max_model_len=8)
    request = make_request("a", 6, max_tokens=100)
    assert step(request, 5, criteria) is None  # 7 tokens
    assert step(request, 6, criteria) is RequestStatus.FINISHED_LENGTH  # 8 tokens


def test_a_json_object_closed_by_its_budget_ends_as_length_on_its_stop_token() -> None:
    """When max_tokens forced a json_object's closing, which completed a token early, the stop token the
    grammar then allows finishes it LENGTH (the budget cut the answer), not STOPPED."""
    request = make_request("a", 4, max_tokens=10)
    request.json_closed_by_budget = True
    assert step(request, 5) is None
    assert step(request, EOS) is RequestStatus.FINISHED_LENGTH and request.stop_reason is None


def test_stop_token_is_checked_before_length() -> None:
    """EOS as the last allowed token reports STOPPED (stop tokens come before length)."""
    request = make_request("a", 4, max_tokens=1)
    assert step(request, EOS) is RequestStatus.FINISHED_STOPPED and request.stop_reason == EOS


def test_stop_string_matcher_finishes_stopped_with_the_string() -> None:
    """A stop string seen by the matcher finishes STOPPED with the string as stop_reason."""
    request = make_request("a", 4)
    matcher = TokenStopMatcher(trigger=30)
    request.stop_matcher = matcher
    assert step(request, 20) is None
    assert step(request, 30) is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == "END" and matcher.seen == [20, 30]


def test_matcher_is_not_fed_a_stop_token() -> None:
    """A stop token ends the request before the matcher sees the token."""
    request = make_request("a", 4)
    matcher = TokenStopMatcher(trigger=EOS)
    request.stop_matcher = matcher
    assert step(request, 20) is None
    assert step(request, EOS) is RequestStatus.FINISHED_STOPPED and request.stop_reason == EOS
    assert matcher.seen == [20]


def test_stop_string_in_the_last_allowed_token_still_stops() -> None:
    """A stop string completed by the last allowed token is found (its text must be cut, as in vLLM)."""
    request = make_request("a", 4, max_tokens=2)
    matcher = TokenStopMatcher(trigger=30)
    request.stop_matcher = matcher
    assert step(request, 20) is None
    assert step(request, 30) is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == "END" and matcher.seen == [20, 30]


def test_process_step_appends_finishes_and_stamps_in_batch_order() -> None:
    """process_step appends each token, hands finished requests to finish, in batch order."""
    scheduler = make_scheduler(num_pages=8)
    batch = [make_request("a", 4, max_tokens=1), make_request("b", 4), make_request("c", 4, logprobs=1)]
    for r in batch:
        scheduler.add(r)
    scheduler.schedule()
    calls: list[tuple[str, RequestStatus]] = []

    def finish(request: Request, status: RequestStatus) -> None:
        calls.append((request.request_id, status))
        scheduler.finish(request, status)

    finished = process_step(batch, [5, 6, EOS], [None, None, {EOS: -0.25}], CRITERIA, finish)
    assert [r.request_id for r in finished] == ["a", "c"]
    assert calls == [("a", RequestStatus.FINISHED_LENGTH), ("c", RequestStatus.FINISHED_STOPPED)]
    assert [r.output_token_ids for r in batch] == [[5], [6], [EOS]]
    assert [r.output_logprobs for r in batch] == [[], [], [{EOS: -0.25}]]
    assert [LifetimeEvent.FINISHED in r.events for r in batch] == [True, False, True]
    assert [r.request_id for r in scheduler.running] == ["b"] and scheduler.pool.free_page_ids() == [3, 4, 5, 6, 7, 0, 2]


def test_process_step_rejects_mismatched_lengths() -> None:
    """tokens and logprobs must match the batch one for one."""
    batch = [make_request("a", 4), make_request("b", 4)]
    with pytest.raises(ValueError):
        process_step(batch, [5], [None, None], CRITERIA, lambda r, s: None)


def test_token_update_reports_only_unsent_outputs() -> None:
    """Each update starts at num_sent_tokens and marks everything sent; a repeat is empty."""
    request = make_request("a", 4, outputs=[40, 41, 42])
    request.num_sent_tokens = 1  # the prefill worker reported the first token
    update = token_update(request)
    assert (update.request_id, update.start_index, update.token_ids) == ("a", 1, [41, 42])
    assert (update.logprobs, update.finish_reason, update.stop_reason, update.events) == (None, None, None, None)
    assert request.num_sent_tokens == 3
    again = token_update(request)
    assert (again.start_index, again.token_ids) == (3, [])


def test_token_update_carries_logprobs_only_when_asked() -> None:
    """Log-probabilities of the unsent outputs travel only for requests that asked for them."""
    request = make_request("a", 4, logprobs=1)
    for token, lp in ((40, {40: -0.5}), (41, {41: -1.0})):
        request.append_output(token, lp)
    request.num_sent_tokens = 1
    assert token_update(request).logprobs == [{41: -1.0}]


def test_token_update_events_only_when_finished_or_asked() -> None:
    """Events travel with with_events, or once finished; never otherwise."""
    request = make_request("a", 4, outputs=[40])
    request.stamp(LifetimeEvent.ARRIVED, 5.0)
    assert token_update(request).events is None
    assert token_update(request, with_events=True).events == {"arrived": 5.0}
    request.status = RequestStatus.FINISHED_LENGTH
    done = token_update(request)
    assert (done.finish_reason, done.stop_reason, done.events) == ("length", None, {"arrived": 5.0})


def test_token_update_stop_reason_is_only_a_stop_token() -> None:
    """A stop token travels as stop_reason; a stop string does not (the front end finds it)."""
    by_token = make_request("a", 4, outputs=[EOS])
    by_token.status, by_token.stop_reason = RequestStatus.FINISHED_STOPPED, EOS
    update = token_update(by_token)
    assert (update.token_ids, update.finish_reason, update.stop_reason) == ([EOS], "stop", EOS)
    by_string = make_request("b", 4, outputs=[30])
    by_string.status, by_string.stop_reason = RequestStatus.FINISHED_STOPPED, "END"
    assert (token_update(by_string).finish_reason, token_update(by_string).stop_reason) == ("stop", None)
    aborted = make_request("c", 4, outputs=[30])
    aborted.status = RequestStatus.FINISHED_ABORTED
    assert token_update(aborted).finish_reason == "abort"
