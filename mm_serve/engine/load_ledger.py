"""The front end's books of the work it sent to the workers, for admission and routing.

Queued prefill work is in prompt tokens left to compute (image tokens included, a cached
prefix not), counted from dispatch until the first token comes back, per prefill worker and
per SLO tier, for the admission controller's prediction of the wait ahead of a new request.
A looser request that has waited past its ``max_wait_s`` is served as the tightest tier by the
disaggregated prefill scheduler, so from then on a view counts it ahead of every tier (the
colocated engine does not age requests: the caller passes no ``max_wait_s`` there). Looser
requests that will age while the new one waits are not counted: ``ahead`` is a lower bound.

Per decode worker it keeps the worker's last :class:`~mm_serve.runtime.messages.WorkerStats`
(pages used, running requests) and the pages of the requests dispatched to it that it has not
claimed yet, which the router's choice of decode worker reads.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mm_serve.engine.load_view import ARRIVAL_WINDOW_S, LoadView, PrefillWork, Promise, Route
from mm_serve.ground.tiers import Tier


@dataclass
class QueuedPrefill:
    """One request dispatched to a prefill worker, until its first token comes back."""

    worker: int
    tokens: int  # prompt tokens left to compute there
    tier: Tier
    images: int  # images to encode there
    ages_at: float | None = None  # when it is served as the tightest tier (monotonic s); None: never
    arrived_at: float | None = None  # its call's arrival when a promise is kept to it (monotonic s)


@dataclass
class Dispatch:
    """One entry of a prefill worker's arrival window."""

    at: float  # monotonic seconds
    tokens: int
    images: int


@dataclass
class PrefillLoad:
    """What the ledger knows of one prefill worker."""

    queued_tokens: int = 0  # prompt tokens queued or prefilling there, all tiers
    by_tier: list[PrefillWork] = field(default_factory=lambda: [PrefillWork() for _ in Tier])
    # the ids of its batch in progress and when it started (monotonic s); None until the worker
    # first reports a batch (colocated workers do not)
    batch: set[str] | None = None
    batch_started: float = 0.0
    window: deque[Dispatch] = field(default_factory=deque)  # dispatches of the last ARRIVAL_WINDOW_S
    windowed: PrefillWork = field(default_factory=PrefillWork)  # the sum of ``window``


@dataclass
class DecodeLoad:
    """What the ledger knows of one decode worker."""

    pages_total: int
    pages_used: int = 0  # from the last stats report
    running: int = 0  # from the last stats report
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> pages it will need
    by_tier: list[int] = field(default_factory=lambda: [0] * len(Tier))  # live requests sent here, per tier

    def free_after_inflight(self) -> int:
        """Free pages once the requests dispatched here and not yet claimed are."""
        return self.pages_total - self.pages_used - sum(self.inflight.values())

    def tightest(self) -> Tier | None:
        """The tightest tier among the requests sent here and not finished (None: none)."""
        return next((Tier(rank) for rank, count in enumerate(self.by_tier) if count > 0), None)


@dataclass
class DecodeEntry:
    """A request routed to a decode worker, until it finishes."""

    worker: int
    tier: Tier


class LoadLedger:
    """Work dispatched to ``num_prefill`` prefill and ``num_decode`` decode workers."""

    def __init__(self, num_prefill: int, num_decode: int, decode_pages_total: int) -> None:
        self.prefill = [PrefillLoad() for _ in range(num_prefill)]
        self.decode = [DecodeLoad(decode_pages_total) for _ in range(num_decode)]
        self._queued: dict[str, QueuedPrefill] = {}
        self._decoding: dict[str, DecodeEntry] = {}

    @property
    def prefill_tokens(self) -> list[int]:
        """Prompt tokens queued or prefilling on each prefill worker."""
        return [load.queued_tokens for load in self.prefill]

    def dispatched(self, request_id: str, prefill: int, decode: int, tokens: int, pages: int,
                   tier: Tier = Tier.STANDARD, images: int = 0, max_wait_s: float = 0.0, now: float | None = None,
                   arrived_at: float | None = None) -> None:
        """Count a request sent to ``prefill`` (``tokens`` prompt tokens and ``images`` images left
        to compute there) whose KV goes to ``decode`` (``pages`` pages for the prompt and first
        token). A request of a tier looser than the tightest with ``max_wait_s`` > 0 counts as the
        tightest tier in :meth:`view` once it has waited that long after ``now`` (``time.monotonic()``
        seconds, default the present); one with ``arrived_at`` (when its call reached the server,
        monotonic seconds) is a :class:`Promise` in the views of tighter tiers while it is queued and
        not aged. An id already counted is forgotten first."""
        if request_id in self._decoding or request_id in self._queued:
            self.finished(request_id)
        at = time.monotonic() if now is None else now
        looser = tier > Tier.INTERACTIVE
        self._queued[request_id] = QueuedPrefill(prefill, tokens, tier, images,
                                                 at + max_wait_s if looser and max_wait_s > 0 else None,
                                                 arrived_at if looser else None)
        load = self.prefill[prefill]
        load.queued_tokens += tokens
        load.by_tier[tier].add(1, tokens, images)
        load.window.append(Dispatch(at, tokens, images))
        load.windowed.add(1, tokens, images)
        self._recent(prefill, at)  # drops what fell out of the window
        self.decode[decode].inflight[request_id] = pages
        self.decode[decode].by_tier[tier] += 1
        self._decoding[request_id] = DecodeEntry(decode, tier)

    def view(self, tier: Tier, route: Route, now: float | None = None) -> LoadView:
        """The :class:`LoadView` of a request of ``tier`` sent along ``route``, at ``now``
        (``time.monotonic()`` seconds, default the present): looser requests that have aged to the
        tightest tier by then count as ahead. Read-only."""
        ahead, looser = PrefillWork(), PrefillWork()
        for queued_tier, work in zip(Tier, self.prefill[route.prefill].by_tier, strict=True):
            (ahead if queued_tier <= tier else looser).include(work)
        now = time.monotonic() if now is None else now
        for queued in self._on(route.prefill):
            if queued.tier > tier and self._aged(queued, now):  # served as the tightest now: ahead of any
                looser.add(-1, queued.tokens, queued.images)
                ahead.add(1, queued.tokens, queued.images)
        running, elapsed = self._running(route.prefill, tier, ahead, looser, now)
        load = self.decode[route.decode]
        promises = self._promises(route.prefill, tier, now) if running is not None else ()
        return LoadView(route.prefill, ahead, route.decode, load.running + len(load.inflight), load.pages_used,
                        load.tightest(), route.cached_pages, looser=looser, running=running,
                        running_elapsed_s=elapsed, recent=self._recent(route.prefill, now), promises=promises)

    def _on(self, prefill: int) -> list[QueuedPrefill]:
        """The requests queued or prefilling on ``prefill``, in dispatch order."""
        return [queued for queued in self._queued.values() if queued.worker == prefill]

    @staticmethod
    def _aged(queued: QueuedPrefill, now: float) -> bool:
        """Whether ``queued`` is served as the tightest tier by ``now`` (ageing)."""
        return queued.ages_at is not None and queued.ages_at <= now

    def _promises(self, prefill: int, tier: Tier, now: float) -> tuple[Promise, ...]:
        """The :class:`Promise` of each request queued on ``prefill`` (not in its batch in progress)
        of a tier looser than ``tier``, dispatched with its arrival time and not aged by ``now``:
        the work served before it is the queued work of tighter tiers (aged requests count as the
        tightest) and of its own tier dispatched before it (the prefill queue orders by tier, then
        arrival)."""
        in_batch = self.prefill[prefill].batch or set()
        queued = [(request_id, Tier.INTERACTIVE if self._aged(q, now) else q.tier, q)
                  for request_id, q in self._queued.items() if q.worker == prefill and request_id not in in_batch]
        if not any(q.arrived_at is not None for _, _, q in queued):
            return ()
        by_tier = [PrefillWork() for _ in Tier]
        for _, served_as, q in queued:
            by_tier[served_as].add(1, q.tokens, q.images)
        so_far = [PrefillWork() for _ in Tier]  # of each tier, dispatched up to the one at hand
        promises = []
        for _, served_as, q in queued:
            so_far[served_as].add(1, q.tokens, q.images)
            if served_as > tier and q.arrived_at is not None:
                through = PrefillWork()
                for work in [*by_tier[:served_as], so_far[served_as]]:
                    through.include(work)
                promises.append(Promise(served_as, q.arrived_at, through))
        return tuple(promises)

    def _recent(self, prefill: int, now: float) -> PrefillWork:
        """The work dispatched to ``prefill`` in the :data:`ARRIVAL_WINDOW_S` seconds before ``now``."""
        load = self.prefill[prefill]
        while load.window and load.window[0].at < now - ARRIVAL_WINDOW_S:
            gone = load.window.popleft()
            load.windowed.add(-1, gone.tokens, gone.images)
        return PrefillWork(load.windowed.requests, load.windowed.tokens, load.windowed.images)

    def _running(self, prefill: int, tier: Tier, ahead: PrefillWork, looser: PrefillWork,
                 now: float) -> tuple[PrefillWork | None, float]:
        """(work, seconds since it started) of the batch in progress on ``prefill``, moved out of
        ``ahead`` and ``looser`` (tiers up to ``tier`` and aged requests are in ``ahead``); (None, 0)
        when the worker does not report its batches."""
        load = self.prefill[prefill]
        if load.batch is None:
            return None, 0.0
        running = PrefillWork()
        for request_id in load.batch:
            queued = self._queued.get(request_id)
            if queued is None:
                continue
            counted_in = ahead if queued.tier <= tier or self._aged(queued, now) else looser
            counted_in.add(-1, queued.tokens, queued.images)
            running.add(1, queued.tokens, queued.images)
        return running, (max(0.0, now - load.batch_started) if running.requests else 0.0)

    def batch_started(self, prefill: int, request_ids: Sequence[str], now: float | None = None) -> None:
        """Prefill worker ``prefill`` started a batch of ``request_ids`` at ``now`` (``time.monotonic()``
        seconds, default the present): until their first tokens come back, :meth:`view` counts
        them as in progress there, not as queued."""
        load = self.prefill[prefill]
        load.batch = {i for i in request_ids if i in self._queued}
        load.batch_started = time.monotonic() if now is None else now

    def queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) dispatched to prefill workers and not yet prefilled."""
        return len(self._queued), sum(self.prefill_tokens)

    def prefilled(self, request_id: str) -> None:
        """The first token came back: the request left its prefill queue."""
        queued = self._queued.pop(request_id, None)
        if queued is not None:
            load = self.prefill[queued.worker]
            if load.batch is not None:
                load.batch.discard(request_id)
            load.queued_tokens -= queued.tokens
            load.by_tier[queued.tier].add(-1, queued.tokens, queued.images)

    def claimed(self, request_id: str) -> None:
        """The decode worker reported the request (its pages now count in the worker's stats)."""
        entry = self._decoding.get(request_id)
        if entry is not None:
            self.decode[entry.worker].inflight.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        """The request finished (or was dropped): forget it everywhere."""
        self.prefilled(request_id)
        self.claimed(request_id)
        entry = self._decoding.pop(request_id, None)
        if entry is not None:
            self.decode[entry.worker].by_tier[entry.tier] -= 1

    def decode_of(self, request_id: str) -> int | None:
        """The decode worker of an unfinished request (None: not known)."""
        entry = self._decoding.get(request_id)
        return None if entry is None else entry.worker

    def prefill_of(self, request_id: str) -> int | None:
        """The prefill worker of a request not yet prefilled (None: not queued)."""
        queued = self._queued.get(request_id)
        return None if queued is None else queued.worker

    def reset_prefill(self, index: int) -> None:
        """Prefill worker ``index`` failed: its batch in progress is gone with it."""
        load = self.prefill[index]
        if load.batch is not None:
            load.batch, load.batch_started = set(), time.monotonic()

    def reset_decode(self, index: int) -> None:
        """Decode worker ``index`` failed: forget its last stats (its restart reports afresh)."""
        load = self.decode[index]
        load.pages_used = load.running = 0

    def update_decode_stats(self, index: int, pages_used: int, pages_total: int, running: int) -> None:
        """Decode worker ``index`` reported its pages in use, its page count and its running requests."""
        load = self.decode[index]
        load.pages_used, load.pages_total, load.running = pages_used, pages_total, running
