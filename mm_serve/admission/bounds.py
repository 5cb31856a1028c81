"""Hard bounds that hold whatever the predictor says: one call's work, and the queues.

A call's *work* is the tokens it makes the service hold and compute: for each prompt
and each of its ``n`` choices, prompt tokens (image tokens included) plus ``max_tokens``.
The queue caps count engine requests still waiting for their first token (queued or
prefilling, on every prefill worker) and their prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from mm_serve.admission.rejection import Rejection
from mm_serve.config import AdmissionConfig

QUEUE_RETRY_AFTER_S = 1.0  # a queue over its cap drains within about a second of prefill


def call_work(prompt_tokens: Sequence[int], max_tokens: Sequence[int], n: int) -> int:
    """Tokens of work of one call: sum over prompts of ``n * (prompt + max_tokens)``."""
    return sum(n * (p + m) for p, m in zip(prompt_tokens, max_tokens, strict=True))


def check_work(prompt_tokens: Sequence[int], max_tokens: Sequence[int], n: int, cfg: AdmissionConfig,
               field: str = "max_tokens") -> None:
    """Refuse a call over ``admission.max_request_work_tokens``; ``field`` is the body field its output
    limit came from (``max_tokens`` or ``max_completion_tokens``), named in the error.

    Raises:
        Rejection: 400 ``work_limit``; the message gives the call's work and the limit.
    """
    work = call_work(prompt_tokens, max_tokens, n)
    if work > cfg.max_request_work_tokens:
        raise Rejection(
            400, "work_limit",
            f"this request asks for {work} tokens of work ({len(prompt_tokens)} prompt(s) x n={n} x "
            f"(prompt + {field})); the limit is {cfg.max_request_work_tokens} "
            f"(admission.max_request_work_tokens): send fewer prompts, a smaller n or {field}",
            param=field,
        )


def check_queues(queued_requests: int, queued_tokens: int, new_requests: int, new_tokens: int,
                 cfg: AdmissionConfig) -> None:
    """Refuse a call whose requests would push the prefill queues over their caps.

    Args:
        queued_requests, queued_tokens: engine requests (and their prompt tokens) waiting for
            their first token now.
        new_requests, new_tokens: what this call adds.

    Raises:
        Rejection: 429 ``queued_requests`` or ``queued_tokens`` with a Retry-After.
    """
    if queued_requests + new_requests > cfg.max_queued_requests:
        raise Rejection(
            429, "queued_requests",
            f"the service is overloaded: {queued_requests} requests are waiting for prefill and this call adds "
            f"{new_requests}; the cap is {cfg.max_queued_requests} (admission.max_queued_requests)",
            QUEUE_RETRY_AFTER_S,
        )
    if queued_tokens + new_tokens > cfg.max_queued_prompt_tokens:
        raise Rejection(
            429, "queued_tokens",
            f"the service is overloaded: {queued_tokens} prompt tokens are waiting for prefill and this call adds "
            f"{new_tokens}; the cap is {cfg.max_queued_prompt_tokens} (admission.max_queued_prompt_tokens)",
            QUEUE_RETRY_AFTER_S,
        )
