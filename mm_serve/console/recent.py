"""The dashboard's waterfall: where each recent request's time went, phase by phase, from the lifetime
events its workers stamped (:class:`~mm_serve.runtime.lifetime.LifetimeEvent`) and its arrival and
finish at the front end.

Phases, in seconds from the call's arrival: ``front end`` (parse, media, admission, until a worker is
sent the request), ``queue`` (waiting in the prefill or colocated worker's queue), ``encode`` (the vision
tower), ``prefill`` (the LLM prefill, to the first token), ``hand-off`` (the KV through the ring to the
decode worker), ``decode queue`` (until its first decode step) and ``decode`` (first decode step to the
last token). The colocated worker stamps no batch events: its wait and prefill are one phase,
``queue + prefill``. A phase whose events a path does not
stamp (no image: no encode; colocated: no hand-off) is left out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from mm_serve.engine.request_state import RequestState
from mm_serve.runtime.lifetime import LifetimeEvent as E

RECENT = 40  # requests kept

# (phase, its start events (the first stamped counts), its end events)
_PHASES = (
    ("front end", (), (E.ARRIVED,)),
    ("queue", (E.PREFILL_QUEUED, E.ARRIVED), (E.ENCODE_BEGIN, E.PREFILL_BEGIN)),
    ("encode", (E.ENCODE_BEGIN,), (E.ENCODE_END,)),
    ("prefill", (E.PREFILL_BEGIN, E.ENCODE_END), (E.PREFILL_END,)),
    ("hand-off", (E.HANDOFF_BEGIN,), (E.HANDOFF_END,)),
    ("decode queue", (E.HANDOFF_END,), (E.FIRST_DECODE,)),
    ("decode", (E.FIRST_DECODE, E.PREFILL_END), (E.FINISHED,)),
)


def phases(events: dict[str, float], arrival_wall: float, finish_wall: float) -> list[dict[str, Any]]:
    """The phases of one request (``name``, ``start_s``, ``end_s`` from its arrival) from its ``events``
    (event value -> ``time.time()`` seconds), its arrival and its finish (``time.time()`` seconds)."""
    at = {E.FINISHED.value: finish_wall, **events}
    out = []
    for name, starts, ends in _PHASES:
        start = next((at[e.value] for e in starts if e.value in at), arrival_wall if not starts else None)
        end = next((at[e.value] for e in ends if e.value in at), None)
        if start is not None and end is not None and end >= start:
            out.append({"name": name, "start_s": max(0.0, start - arrival_wall), "end_s": max(0.0, end - arrival_wall)})
    names = {phase["name"] for phase in out}
    queued = at.get(E.PREFILL_QUEUED.value, at.get(E.ARRIVED.value))
    first = at.get(E.PREFILL_END.value)
    if not names & {"queue", "encode", "prefill"} and queued is not None and first is not None and first >= queued:
        # a worker that stamps no batch events (the colocated one): its wait and prefill as one phase
        out.insert(1, {"name": "queue + prefill", "start_s": max(0.0, queued - arrival_wall),
                       "end_s": max(0.0, first - arrival_wall)})
    return out


class RecentRequests:
    """The last :data:`RECENT` finished requests with their phases; :meth:`observe` is an engine-client
    finish listener (receiver thread), :meth:`rows` is read by the dashboard's endpoint."""

    def __init__(self, size: int = RECENT) -> None:
        self._rows: deque[dict[str, Any]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def observe(self, state: RequestState) -> None:
        """Record a finished request (one that produced a token; failed and cancelled ones are not drawn)."""
        if state.first_token_time is None:
            return
        offset = time.time() - time.monotonic()  # its times are monotonic, its events wall-clock
        arrival = state.arrival_time + offset
        finish = (state.finish_time or time.monotonic()) + offset
        row = {"id": state.request_id[-8:], "tier": state.tier.label if state.tier is not None else "standard",
               "finished_at": finish, "ttft_s": state.first_token_time - state.arrival_time,
               "e2e_s": finish - arrival, "tokens": len(state.token_ids), "finish_reason": state.finish_reason,
               "phases": phases(dict(state.events), arrival, finish)}
        with self._lock:
            self._rows.append(row)

    def rows(self) -> list[dict[str, Any]]:
        """The recorded requests, newest first."""
        with self._lock:
            return list(reversed(self._rows))
