"""The step after sampling, written once for every loop (prefill, decode, colocated).

:func:`process_step` appends each sampled token to its request, decides whether the
request is finished and why (:func:`check_stop`), and hands finished requests to the
caller's ``finish`` (the scheduler's, which frees their pages). :func:`token_update`
builds the message that reports a request's new outputs to the front end. The order
of the stop checks: stop tokens, then stop strings, then length (a stop string that
the last allowed token completes still stops the request and is cut, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mm_serve.runtime import messages
from mm_serve.runtime.lifetime import LifetimeEvent, events_to_wire
from mm_serve.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class StopCriteria:
    """What ends a request besides its own ``max_tokens`` and stop tokens.

    ``eos_token_ids`` are checked unless the request has ``ignore_eos`` (workers pass
    an empty set: the front end folds EOS into ``stop_token_ids``, see
    :mod:`mm_serve.runtime.sampling_wire`); ``max_model_len`` is the context limit in
    tokens (:meth:`~mm_serve.runtime.engine_config.EngineConfig.context_limit`).
    """

    eos_token_ids: frozenset[int]
    max_model_len: int


def check_stop(request: Request, token: int, criteria: StopCriteria) -> RequestStatus | None:
    """Finished status after ``token`` was appended to ``request``'s outputs, or None to continue.

    Order: EOS (unless ``ignore_eos``) and ``stop_token_ids`` → ``FINISHED_STOPPED``; a
    structured request's grammar complete (its matcher terminated) → ``FINISHED_STOPPED``; a
    stop string seen by the request's ``stop_matcher`` → ``FINISHED_STOPPED`` (also when
    the same token reaches the length limit, as the front end's stop-string cut and vLLM
    do); ``max_tokens`` or the context length reached → ``FINISHED_LENGTH``. Sets
    ``request.stop_reason`` to the stop token or the stop string that matched. A ``json_object`` output
    whose closing ``max_tokens`` forced (``request.json_closed_by_budget``) ends ``FINISHED_LENGTH`` on
    its stop token too: the budget cut it.
    """
    params = request.sampling_params
    stopped = RequestStatus.FINISHED_LENGTH if request.json_closed_by_budget else RequestStatus.FINISHED_STOPPED
    if (not params.ignore_eos and token in criteria.eos_token_ids) or token in params.stop_token_ids:
        request.stop_reason = token if stopped is RequestStatus.FINISHED_STOPPED else None
        return stopped
    grammar = request.grammar_matcher
    if grammar is not None and grammar.is_terminated():  # type: ignore[attr-defined]  # its grammar is complete
        request.stop_reason = token if token in params.stop_token_ids and not request.json_closed_by_budget else None
        return stopped
    matcher = request.stop_matcher
    if matcher is not None:
        matcher.add([token])
        if matcher.stopped:
            request.stop_reason = matcher.stop_string
            return RequestStatus.FINISHED_STOPPED
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= criteria.max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def process_step(
    batch: Sequence[Request], tokens: Sequence[int], logprobs: Sequence[dict[int, float] | None],
    criteria: StopCriteria, finish: Callable[[Request, RequestStatus], None],
) -> list[Request]:
    """Append ``tokens[i]`` (and ``logprobs[i]``) to ``batch[i]``; finish those that are done.

    ``finish(request, status)`` must set ``request.status`` and release what the request
    holds (pages, queue entries). Finished requests are stamped
    :attr:`~LifetimeEvent.FINISHED`. A request whose grammar could not go on in this step
    (``request.grammar_failure``, set by the grammar book's mask) gets no token and ends
    ``FINISHED_ABORTED``; its update says why (:func:`token_update`). One whose grammar was
    complete before this step's token (``request.grammar_complete``) gets no token and ends
    ``FINISHED_STOPPED``.

    Returns:
        The requests of ``batch`` that finished in this step, in batch order.

    Raises:
        ValueError: the three sequences differ in length.
    """
    finished: list[Request] = []
    for request, token, lp in zip(batch, tokens, logprobs, strict=True):
        if request.grammar_failure is not None:  # its grammar cannot go on: it ends with that error, token dropped
            status: RequestStatus | None = RequestStatus.FINISHED_ABORTED
        elif request.grammar_complete:  # its grammar was complete before this token: it ends, token dropped
            status = RequestStatus.FINISHED_STOPPED
        else:
            request.append_output(token, lp)
            status = check_stop(request, token, criteria)
        if status is not None:
            finish(request, status)
            request.stamp(LifetimeEvent.FINISHED)
            finished.append(request)
    return finished


def token_update(request: Request, with_events: bool = False) -> messages.TokenUpdate:
    """The outputs of ``request`` not yet reported, as one update; marks them reported.

    Carries the finish reason (and the stop token) once the request is finished, and its
    lifetime events then, or always with ``with_events``; a request ended by its
    ``grammar_failure`` finishes as ``"error"`` with that message.
    """
    start = request.num_sent_tokens
    reason = "error" if request.grammar_failure is not None and request.status.finished else request.finish_reason
    asked_logprobs = request.sampling_params.logprobs is not None
    update = messages.TokenUpdate(
        request.request_id, start, request.output_token_ids[start:],
        request.output_logprobs[start:] if asked_logprobs else None, reason,
        request.stop_reason if reason == "stop" and isinstance(request.stop_reason, int) else None,
        events_to_wire(request.events) if with_events or reason is not None else None,
        request.num_prompt_cached_tokens if start == 0 and request.output_token_ids else None,
        request.prompt_logprobs if start == 0 and request.output_token_ids else None,
        request.grammar_failure if reason == "error" else None,
    )
    request.num_sent_tokens = len(request.output_token_ids)
    return update
