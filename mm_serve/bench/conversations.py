"""Closed-loop conversations inside an open-loop run: which requests chain, when they start, their history.

Open-loop requests arrive on their own (the arrival process). The turns of a
conversation do not: the conversation *starts* at an arrival time, and turn k + 1 is
sent once turn k has been answered (and not before its own planned time, for a
replayed trace), its ``messages`` holding the whole history: every earlier user
message exactly as it was sent (the same ``image_url`` part, byte for byte) and every
answer as an assistant message, then the new user message. That is what multi-turn
chat clients send, and what a prefix cache sees.

Rates stay in requests/s for every workload: conversations start at
``rate / (mean turns per conversation)`` per second, so a run at R requests/s offers
about R requests/s in the long run, whatever the workload.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mm_serve.bench.requests import PlannedRequest
from mm_serve.workloads.spec import RequestSpec, conversation_groups


def whole_conversations(specs: Sequence[RequestSpec], n: int) -> list[RequestSpec]:
    """The shortest prefix of ``specs`` with at least ``n`` requests that ends on a whole
    conversation (``specs`` grouped by conversation, as the workloads sample them)."""
    if n >= len(specs):
        return list(specs)
    end = n
    last = specs[n - 1].conversation_id if n > 0 else None
    while last is not None and end < len(specs) and specs[end].conversation_id == last:
        end += 1
    return list(specs[:end])


def conversation_arrivals(specs: Sequence[RequestSpec], unit_starts: Sequence[float],
                          rate: float) -> list[float]:
    """Planned send times (seconds) of ``specs`` at ``rate`` requests/s.

    ``unit_starts`` are the start times of the conversations (requests outside a
    conversation count as conversations of one) on a unit-rate path, one per
    conversation in order of first appearance. Every turn gets its conversation's start,
    so later turns go out as soon as the turn before them is answered.

    Raises:
        ValueError: ``unit_starts`` has not one time per conversation.
    """
    groups = conversation_groups([s.conversation_id for s in specs])
    if len(groups) != len(unit_starts):
        raise ValueError(f"{len(groups)} conversations but {len(unit_starts)} start times")
    per_conversation = len(specs) / max(1, len(groups))
    out = [0.0] * len(specs)
    for group, start in zip(groups, unit_starts, strict=True):
        for i in group:
            out[i] = start * per_conversation / rate
    return out


def request_chains(plan: Sequence[PlannedRequest]) -> list[list[int]]:
    """Plan positions that are sent one after the other: each conversation's turns in turn
    order; every other request alone."""
    groups = conversation_groups([p.conversation for p in plan])
    return [sorted(group, key=lambda i: plan[i].turn or 0) for group in groups]


class History:
    """The messages a conversation has exchanged so far; builds each turn's body on top of them."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []  # user and assistant messages, in order

    def body(self, req: PlannedRequest) -> bytes:
        """``req``'s body with the history in front of its own messages (``req.body`` unchanged
        outside a conversation)."""
        if req.conversation is None:
            return req.body
        payload = json.loads(req.body)
        payload["messages"] = [*self.messages, *payload["messages"]]
        return json.dumps(payload).encode()

    def answered(self, req: PlannedRequest, answer: str) -> None:
        """Record that ``req`` was answered with ``answer`` (the streamed content, joined)."""
        if req.conversation is None:
            return
        self.messages += json.loads(req.body)["messages"]
        self.messages.append({"role": "assistant", "content": answer})
