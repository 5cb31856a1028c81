"""What a new request would find on the workers it would be sent to: the records the load
ledger (:mod:`mm_serve.engine.load_ledger`) reports and the admission controller reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_serve.ground.tiers import Tier

ARRIVAL_WINDOW_S = 5.0  # the window over which a prefill worker's recent dispatches are counted (LoadView.recent)


@dataclass
class PrefillWork:
    """Requests, prompt tokens and images queued (or prefilling) on one prefill worker."""

    requests: int = 0
    tokens: int = 0
    images: int = 0

    def add(self, sign: int, tokens: int, images: int) -> None:
        """Count one request of ``tokens`` tokens and ``images`` images in (``sign`` 1) or out (-1)."""
        self.requests += sign
        self.tokens += sign * tokens
        self.images += sign * images

    def include(self, other: PrefillWork) -> None:
        """Add all of ``other`` (its requests, tokens and images) to this."""
        self.requests += other.requests
        self.tokens += other.tokens
        self.images += other.images


@dataclass(frozen=True)
class Route:
    """Where the router would send a request: its prefill and decode worker, and how many of its
    full pages it believes that prefill worker holds cached."""

    prefill: int
    decode: int
    cached_pages: int = 0


@dataclass(frozen=True)
class Promise:
    """A request queued on a prefill worker that a new request of a tighter tier would be served
    before: it was admitted on a prediction, and each such new request delays its first token."""

    tier: Tier  # its tier
    arrived_at: float  # when its call reached the server (``time.monotonic()`` seconds)
    through: PrefillWork  # the queued work served before it, and itself (not the batch in progress)


@dataclass(frozen=True)
class LoadView:
    """What a new request of one tier would find on the workers it would be sent to."""

    prefill: int  # the prefill worker it would go to
    ahead: PrefillWork  # queued or prefilling there at its tier and tighter ones
    decode: int  # the decode worker it would go to
    decode_batch: int  # requests running on or dispatched to that decode worker
    decode_pages_used: int  # KV pages used there (last stats)
    decode_tightest: Tier | None = None  # tightest tier among the requests live there
    cached_pages: int = 0  # full pages of the request believed cached on that prefill worker
    cached_tokens: int = 0  # of its prompt, tokens that would not be prefilled (the caller fills these two
    cached_images: int = 0  # ... from cached_pages: it knows the page size and where the images are)
    in_flight: int = 0  # requests unfinished on the whole service (the caller fills it)
    looser: PrefillWork = field(default_factory=PrefillWork)  # queued or prefilling there at looser tiers
    # the batch prefilling there now, any tier, and seconds since it started; None when the worker
    # does not report its batches (then ``ahead`` and ``looser`` include it)
    running: PrefillWork | None = None
    running_elapsed_s: float = 0.0
    # work dispatched to that prefill worker in the last ARRIVAL_WINDOW_S seconds (its arrival rate)
    recent: PrefillWork = field(default_factory=PrefillWork)
    # the queued requests there of looser tiers, not aged, dispatched with their arrival time: the
    # new request would be served before each (only on a worker that reports its batches)
    promises: tuple[Promise, ...] = ()
