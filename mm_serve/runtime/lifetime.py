"""Lifetime events of a request, as an enum (DistServe's ``lifetime.py`` idea).

Each event is stamped once with wall-clock ``time.time()`` seconds, in the process
where it happens, and travels with the request (hand-off meta, token updates) so the
front end can split TTFT into queueing, encode, prefill and hand-off
(:mod:`mm_serve.metrics.service_metrics`). On the wire the keys are the enum values (plain strings).
"""

from __future__ import annotations

import enum


class LifetimeEvent(str, enum.Enum):
    """Points in a request's life, in the order a disaggregated request passes them."""

    ARRIVED = "arrived"  # the front end sent it to a worker
    PREFILL_QUEUED = "prefill_queued"  # a prefill (or colocated) worker queued it
    ENCODE_BEGIN = "encode_begin"  # its prefill batch started the vision tower
    ENCODE_END = "encode_end"  # ... and finished it
    PREFILL_BEGIN = "prefill_begin"  # the LLM prefill of its batch started
    PREFILL_END = "prefill_end"  # its first token was sampled
    HANDOFF_BEGIN = "handoff_begin"  # its KV was queued for the ring
    HANDOFF_END = "handoff_end"  # the decode worker copied its KV out of the ring
    FIRST_DECODE = "first_decode"  # its first decode step ran
    FINISHED = "finished"  # its last token was sampled


def events_to_wire(events: dict[LifetimeEvent, float]) -> dict[str, float]:
    """Plain-string keys for a message (``{"arrived": 1.7e9, ...}``)."""
    return {event.value: seconds for event, seconds in events.items()}


def events_from_wire(events: dict[str, float]) -> dict[LifetimeEvent, float]:
    """Enum keys from a message; unknown names (a newer peer) are dropped."""
    known = {event.value: event for event in LifetimeEvent}
    return {known[name]: seconds for name, seconds in events.items() if name in known}
