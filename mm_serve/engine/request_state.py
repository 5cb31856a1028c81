"""Front-end view of one in-flight request: tokens as they arrive, text deltas, completion."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mm_serve.ground.tiers import Tier
from mm_serve.runtime import messages
from mm_serve.runtime.detokenizer import IncrementalDetokenizer

ABORTED = "aborted"  # the error of a request its caller cancelled: not a failure of the service


@dataclass(frozen=True)
class StreamPiece:
    """One read of a running request for its stream (:meth:`RequestState.take`).

    Attributes:
        text: the text since the previous read.
        token_ids: the output token ids from the index asked for on.
        logprobs: their log-probabilities (empty when none were asked for), one dict per token.
        finished: the request had finished when this was read (its last text and tokens are in it).
    """

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finished: bool


class RequestState:
    """Assembles :class:`~mm_serve.runtime.messages.TokenUpdate` s (possibly out of order) into one output.

    Updated by the client's receiver thread; read by the caller. ``listener`` (if
    set) is called from the receiver thread after every change.
    """

    def __init__(self, request_id: str, num_prompt_tokens: int, detokenizer: IncrementalDetokenizer) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_images = 0
        self.counts_inputs = True  # the metrics count its prompt tokens and images (a call's first choice)
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.events: dict[str, float] = {}
        self.listener: Callable[[RequestState], None] | None = None
        self.arrival_time = time.monotonic()  # the submitter may set an earlier time (HTTP receipt)
        self.submitted_at = self.arrival_time  # monotonic, when the engine client took it (made just before dispatch)
        self.first_token_time: float | None = None  # monotonic, first output token received here
        self.token_times: list[float] = []  # monotonic receipt time of each output token
        self.finish_time: float | None = None
        self.tier: Tier | None = None  # the SLO tier it is served in (None: not counted per tier)
        self.predicted_ttft_s: float | None = None  # the admission controller's prediction, seconds
        self.cached_tokens = 0  # prompt tokens whose KV the prefill reused (prefix cache), <= num_prompt_tokens
        # per prompt token (None first), when its params asked (prompt_logprobs): the first attempt's that sent them
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        # moved to a new attempt after a worker fault, or parked while a role had no ready worker: its
        # latency measures the fault, not the load (the admission controller does not learn from it)
        self.delayed_by_fault = False
        # a structured output (grammar): its decode worker compiles the grammar when it takes the request
        # (a fresh one: up to seconds), so the gap before its second token is no decode step
        self.structured = False
        self.invalid_input = False  # it failed for what it asked (its grammar allows no token): a 400, not a 503
        self._cached_reported = False
        self._pending_text: list[str] = []
        self._early: dict[int, messages.TokenUpdate] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def apply(self, update: messages.TokenUpdate) -> bool:
        """Merge an update; returns True when this made the request finish (incl. a stop string)."""
        with self._lock:
            if self._done.is_set():
                return False
            self._early[update.start_index] = update
            finished = False
            while len(self.token_ids) in self._early and not finished:
                finished = self._take(self._early.pop(len(self.token_ids)))
            if not finished and self._early and update.finish_reason == "abort":
                finished = self._finish("abort", None)
        self._notify()
        return finished

    def _take(self, update: messages.TokenUpdate) -> bool:
        now = time.monotonic()
        if update.token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_times.extend([now] * len(update.token_ids))
        self.token_ids.extend(update.token_ids)
        if update.logprobs:
            self.logprobs.extend(update.logprobs)
        if update.events:
            self.events.update(update.events)
        if update.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = update.prompt_logprobs
        if update.cached_tokens is not None and not self._cached_reported:  # the first prefill's figure
            self._cached_reported = True
            self.cached_tokens = min(update.cached_tokens, self.num_prompt_tokens)
        delta = self.detokenizer.add(update.token_ids)
        if delta:
            self._pending_text.append(delta)
        if self.detokenizer.stopped:
            return self._finish("stop", self.detokenizer.stop_string)
        if update.finish_reason == "error":  # the request's own input cannot go on (its grammar allows no token)
            self.error = update.error or "the request cannot go on"
            self.invalid_input = True
            return self._finish("error", None)
        if update.finish_reason is not None:
            return self._finish(update.finish_reason, update.stop_reason)
        return False

    def _finish(self, reason: str, stop_reason: int | str | None) -> bool:
        tail = self.detokenizer.finish()
        if tail:
            self._pending_text.append(tail)
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.finish_time = time.monotonic()
        self._done.set()
        return True

    def fail(self, message: str) -> None:
        """Finish with an error (a worker failed or the service is shutting down)."""
        with self._lock:
            if self._done.is_set():
                return
            self.error = message
            self.finish_reason = "error"
            self.finish_time = time.monotonic()
            self._done.set()
        self._notify()

    def abort(self) -> None:
        """Finish as cancelled by the caller (error :data:`ABORTED`)."""
        self.fail(ABORTED)

    @property
    def aborted(self) -> bool:
        """Whether the caller cancelled it (:meth:`abort`)."""
        return self.error == ABORTED

    @property
    def failure(self) -> str | None:
        """Why the service failed it; None when it did not fail, or was cancelled by its caller."""
        return None if self.error is None or self.aborted else self.error

    @property
    def failure_message(self) -> str | None:
        """:attr:`failure` as the caller reads it: the request failed, or (:attr:`invalid_input`) it cannot be
        completed as asked."""
        failure = self.failure
        if failure is None:
            return None
        return f"the request cannot be completed: {failure}" if self.invalid_input else f"the request failed: {failure}"

    def drop_unordered(self) -> None:
        """Forget updates that arrived ahead of a gap (a failed attempt's; its next attempt
        sends those tokens again)."""
        with self._lock:
            self._early.clear()

    def take(self, sent: int) -> StreamPiece:
        """What a stream sends next, read in one go (the receiver thread adds tokens meanwhile): the text
        since the last call (safe to stream), the token ids and log-probabilities from index ``sent`` on,
        and whether the request had finished by then (so nothing that came with its end is left behind)."""
        with self._lock:
            text = "".join(self._pending_text)
            self._pending_text.clear()
            return StreamPiece(text, self.token_ids[sent:], self.logprobs[sent:], self._done.is_set())

    def served_latency(self) -> tuple[float, float] | None:
        """(TTFT, TPOT) in seconds of a request served to its end (by a stop or the length limit):
        TTFT from its arrival here to its first token, TPOT the mean gap between its output tokens
        (0.0 with one token); None for one cancelled, failed, or still running."""
        if self.first_token_time is None or self.finish_reason not in ("stop", "length"):
            return None
        times = self.token_times
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        return self.first_token_time - self.arrival_time, tpot

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished; False on timeout."""
        return self._done.wait(timeout)

    def _notify(self) -> None:
        listener = self.listener
        if listener is not None:
            listener(self)

    def snapshot(self) -> dict[str, Any]:
        """Plain values for logging and tests."""
        return {"request_id": self.request_id, "tokens": list(self.token_ids), "text": self.text,
                "finish_reason": self.finish_reason, "error": self.error}
