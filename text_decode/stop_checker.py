"""Decide after each new token whether a request is finished, and why."""

from __future__ import annotations

from mm_serve.engine.request import Request, RequestStatus


def check_stop_token(request: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> RequestStatus | None:
    """Finished status after appending ``token`` to ``request``'s outputs, or None to continue.

    Order: EOS (unless ``ignore_eos``) and ``stop_token_ids`` → ``FINISHED_STOPPED``;
    ``max_tokens`` or the context length reached → ``FINISHED_LENGTH``.
    Sets ``request.stop_reason`` to the stop token where one matched.
    """
    params = request.sampling_params
    if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
