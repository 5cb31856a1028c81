"""Request dispatch across prefill and decode workers (xPyD).

* Prefill: with ``cache_aware`` routing (the default; SGLang's ``cache_aware`` policy is the
  reference), the worker believed to hold the longest cached prefix of the request
  (:class:`~mm_serve.engine.prefix_index.PrefixIndex`: its hits on the images of that prefix too),
  unless its queued work exceeds the least-queued worker's by more than ``balance_tokens``;
  otherwise, and with ``least_queued`` routing, the worker with the least queued work. Queued
  work is in prompt tokens left to compute (image tokens included, a cached prefix not),
  counted from dispatch until the first token comes back, the request's own tokens added, and
  weighed by each worker's speed (:meth:`Router.set_prefill_speed`: a worker that shares its
  core with a decode worker runs its batches slower, and an equal share of tokens would make it
  the bottleneck): the worker that would finish the request first. Keeping a conversation on one
  worker keeps its later turns' hits there too. The queued
  work is also kept per SLO tier rank (:class:`PrefillWork`), for the admission
  controller's prediction of the wait ahead of a new request; a looser request that has
  waited past its ``max_wait_s`` is served as rank 0 by the disaggregated prefill
  scheduler, so from then on the view counts it ahead of every tier (the colocated
  engine does not age requests: the caller passes no ``max_wait_s`` there). Looser
  requests that will age while the new one waits are not counted: ``ahead`` is a lower bound.
* Decode: the worker with room, judged from its latest :class:`WorkerStats`
  (free pages, running count) minus what was dispatched to it since: the one
  with the most free pages after its in-flight requests, among those under
  ``decode_max_concurrent``; if none has room, the least loaded (the hand-off
  then waits in its ring, which is backpressure, never a drop).

Only workers the caller names as candidates (the ready ones) are picked: a worker
that is restarting or down gets nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mm_serve.engine.prefix_index import PrefixIndex

NUM_RANKS = 3  # SLO tier ranks: 0 interactive, 1 standard, 2 batch
ARRIVAL_WINDOW_S = 5.0  # the window over which a prefill worker's recent dispatches are counted (LoadView.recent)


@dataclass
class PrefillWork:
    """Requests, prompt tokens and images queued (or prefilling) on one prefill worker for one tier rank."""

    requests: int = 0
    tokens: int = 0
    images: int = 0

    def add(self, sign: int, tokens: int, images: int) -> None:
        self.requests += sign
        self.tokens += sign * tokens
        self.images += sign * images

    def include(self, other: PrefillWork) -> None:
        """Add all of ``other`` (its requests, tokens and images) to this."""
        self.requests += other.requests
        self.tokens += other.tokens
        self.images += other.images


@dataclass
class DecodeLoad:
    """What the router knows of one decode worker."""

    pages_total: int
    pages_used: int = 0  # from the last stats report
    running: int = 0  # from the last stats report
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> pages it will need
    ranks: list[int] = field(default_factory=lambda: [0] * NUM_RANKS)  # live requests sent here, per tier rank

    def free_after_inflight(self) -> int:
        return self.pages_total - self.pages_used - sum(self.inflight.values())

    def tightest_rank(self) -> int | None:
        """The tightest tier rank among the requests sent here and not finished (None: none)."""
        return next((rank for rank, count in enumerate(self.ranks) if count > 0), None)


@dataclass(frozen=True)
class Promise:
    """A request queued on a prefill worker that a new request of a tighter tier would be served
    before: it was admitted on a prediction, and each such new request delays its first token."""

    rank: int  # its tier rank
    arrived_at: float  # when its call reached the server (``time.monotonic()`` seconds)
    through: PrefillWork  # the queued work served before it, and itself (not the batch in progress)


@dataclass(frozen=True)
class LoadView:
    """What a new request of one tier rank would find on the workers it would be sent to."""

    prefill: int  # the prefill worker it would go to
    ahead: PrefillWork  # queued or prefilling there at its rank and tighter ones
    decode: int  # the decode worker it would go to
    decode_batch: int  # requests running on or dispatched to that decode worker
    decode_pages_used: int  # KV pages used there (last stats)
    decode_tightest_rank: int | None = None  # tightest tier rank among the requests live there
    cached_pages: int = 0  # full pages of the request believed cached on that prefill worker
    cached_tokens: int = 0  # of its prompt, tokens that would not be prefilled (the caller fills these two
    cached_images: int = 0  # ... from cached_pages: it knows the page size and where the images are)
    in_flight: int = 0  # requests unfinished on the whole service (the caller fills it)
    looser: PrefillWork = field(default_factory=PrefillWork)  # queued or prefilling there at looser ranks
    # the batch prefilling there now, any rank, and seconds since it started; None when the worker
    # does not report its batches (then ``ahead`` and ``looser`` include it)
    running: PrefillWork | None = None
    running_elapsed_s: float = 0.0
    # work dispatched to that prefill worker in the last ARRIVAL_WINDOW_S seconds (its arrival rate)
    recent: PrefillWork = field(default_factory=PrefillWork)
    # the queued requests there of looser ranks, not aged, dispatched with their arrival time: the
    # new request would be served before each (only on a worker that reports its batches)
    promises: tuple[Promise, ...] = ()


class Router:
    """Chooses workers; the caller reports dispatches, first tokens, finishes and stats."""

    def __init__(
        self, num_prefill: int, num_decode: int, decode_pages_total: int, max_running: int,
        cache_aware: bool = False, balance_tokens: int = 2048, prefill_pages: int = 2048, page_size: int = 16,
        encoder_images: int = 0,
    ) -> None:
        """``cache_aware``: route by cached prefix (``balance_tokens`` queued tokens of slack),
        remembering up to ``prefill_pages`` page hashes (of ``page_size`` tokens) per prefill worker.
        ``encoder_images``: images each prefill worker's encoder cache holds (0: none, every
        image is encoded), remembered by content hash so the work counted for an image sent
        there lately is no image to encode (:meth:`images_to_encode`)."""
        self.cache_aware = cache_aware
        self.page_size = page_size
        self.balance_tokens = balance_tokens
        self.prefixes = PrefixIndex(num_prefill, prefill_pages)
        self.encoded = PrefixIndex(num_prefill, encoder_images) if encoder_images > 0 else None
        self.prefill_tokens = [0] * num_prefill
        self._prefill_of: dict[str, tuple[int, int, int, int]] = {}  # id -> (worker, tokens, rank, images)
        self.prefill_work = [[PrefillWork() for _ in range(NUM_RANKS)] for _ in range(num_prefill)]
        self.decode = [DecodeLoad(decode_pages_total) for _ in range(num_decode)]
        self._decode_of: dict[str, tuple[int, int]] = {}  # id -> (decode worker, tier rank) until finished
        self._ages_at: list[dict[str, float]] = [{} for _ in range(num_prefill)]  # looser id -> when it ages (monotonic s)
        self._arrived_at: list[dict[str, float]] = [{} for _ in range(num_prefill)]  # looser id -> its call's arrival (monotonic s)
        # per prefill worker: the ids of its batch in progress and when it started (monotonic s);
        # None until the worker first reports a batch (colocated workers do not)
        self._batch: list[tuple[set[str], float] | None] = [None] * num_prefill
        self._dispatches: list[deque[tuple[float, int, int]]] = [deque() for _ in range(num_prefill)]  # (when, tokens, images)
        self._dispatched_work = [PrefillWork() for _ in range(num_prefill)]  # the sum of each deque's entries
        self.max_running = max_running
        # per prefill worker: seconds per token relative to the others (1.0 until measured)
        self.prefill_speed = [1.0] * num_prefill

    def set_prefill_speed(self, index: int, factor: float) -> None:
        """Tell the router that prefill worker ``index`` runs its batches ``factor`` times slower
        than a reference (only the ratios between workers matter; the admission controller
        passes its per-worker speed correction, refitted from every prefill batch). A factor
        that is not a positive finite number is ignored."""
        if factor > 0 and math.isfinite(factor):
            self.prefill_speed[index] = factor

    def _prefill_cost(self, worker: int, tokens: int) -> float:
        """The work queued on ``worker`` plus ``tokens`` more, in reference-speed tokens."""
        return (self.prefill_tokens[worker] + tokens) * self.prefill_speed[worker]

    def pick_prefill(self, candidates: Sequence[int] | None = None, page_hashes: Sequence[bytes] = (),
                     tokens: int = 0) -> int:
        """Index of the prefill worker for a request of ``tokens`` prompt tokens whose full pages
        hash to ``page_hashes``, among ``candidates`` (default: all): see the module docstring;
        the least queued work plus its own at each worker's speed, lowest index on ties, when no
        candidate holds a prefix or routing is not cache-aware.

        Raises:
            ValueError: ``candidates`` is empty.
        """
        pool = range(len(self.prefill_tokens)) if candidates is None else candidates
        least = min(pool, key=lambda i: (self._prefill_cost(i, tokens), i))
        if not self.cache_aware or not page_hashes:
            return least
        best = max(pool, key=lambda i: (self.prefixes.match(i, page_hashes), -self._prefill_cost(i, tokens), -i))
        if self.prefixes.match(best, page_hashes) == 0:
            return least
        if self._prefill_cost(best, tokens) - self._prefill_cost(least, tokens) > self.balance_tokens:
            return least
        return best

    def cached_tokens(self, worker: int, page_hashes: Sequence[bytes]) -> int:
        """Tokens of a request (full pages hashing to ``page_hashes``) believed cached on ``worker``."""
        return self.prefixes.match(worker, page_hashes) * self.page_size if self.cache_aware else 0

    def pick_decode(self, pages_needed: int, candidates: Sequence[int] | None = None) -> int:
        """Index of the decode worker with the most room for ``pages_needed`` more pages, among
        ``candidates`` (default: all).

        Raises:
            ValueError: ``candidates`` is empty.
        """

        def room(i: int) -> tuple[bool, int, int]:
            load = self.decode[i]
            busy = load.running + len(load.inflight)
            fits = busy < self.max_running and load.free_after_inflight() >= pages_needed
            return (fits, load.free_after_inflight(), -busy)

        return max(range(len(self.decode)) if candidates is None else candidates, key=room)

    def images_to_encode(self, worker: int, image_hashes: Sequence[bytes]) -> list[bool]:
        """For each image (by content hash), whether prefill worker ``worker`` would run the vision
        tower on it: not in its encoder cache as far as the router knows, and not an earlier
        image of the same request (all True without an encoder cache)."""
        held = self.encoded.held(worker, image_hashes) if self.encoded is not None else [False] * len(image_hashes)
        return [not h and digest not in image_hashes[:i] for i, (h, digest) in enumerate(zip(held, image_hashes, strict=True))]

    def dispatched(self, request_id: str, prefill: int, decode: int, tokens: int, pages: int,
                   rank: int = 1, images: int = 0, page_hashes: Sequence[bytes] = (),
                   max_wait_s: float = 0.0, now: float | None = None, arrived_at: float | None = None,
                   image_hashes: Sequence[bytes] = ()) -> None:
        """Count a request sent to ``prefill`` (``tokens`` prompt tokens, ``images`` images, tier
        ``rank``, full pages hashing to ``page_hashes``) whose KV goes to ``decode`` (``pages``
        pages for the prompt and first token). Given its images' content hashes
        (``image_hashes``, one per image), only those :meth:`images_to_encode` count as images,
        and that worker's encoder cache is believed to hold them from now on. A request of rank > 0 with ``max_wait_s`` > 0
        counts as rank 0 in :meth:`view` once it has waited that long after ``now``
        (``time.monotonic()`` seconds, default the present). A request of rank > 0 with ``arrived_at``
        (when its call reached the server, monotonic seconds) is a :class:`Promise` in the views
        of tighter ranks while it is queued and not aged. An id already counted is forgotten first."""
        if request_id in self._decode_of or request_id in self._prefill_of:
            self.finished(request_id)
        rank = min(max(rank, 0), NUM_RANKS - 1)
        if self.encoded is not None and len(image_hashes) == images:
            images = sum(self.images_to_encode(prefill, image_hashes))
            self.encoded.record(prefill, image_hashes)
        if self.cache_aware and page_hashes:
            tokens -= min(self.cached_tokens(prefill, page_hashes), tokens - 1)  # the work left to compute
            self.prefixes.record(prefill, page_hashes)
        self.prefill_tokens[prefill] += tokens
        self._prefill_of[request_id] = (prefill, tokens, rank, images)
        at = time.monotonic() if now is None else now
        self._dispatches[prefill].append((at, tokens, images))
        self._dispatched_work[prefill].add(1, tokens, images)
        self._recent(prefill, at)  # drops what fell out of the window
        self.prefill_work[prefill][rank].add(1, tokens, images)
        if rank > 0 and max_wait_s > 0:
            self._ages_at[prefill][request_id] = (time.monotonic() if now is None else now) + max_wait_s
        if rank > 0 and arrived_at is not None:
            self._arrived_at[prefill][request_id] = arrived_at
        self.decode[decode].inflight[request_id] = pages
        self.decode[decode].ranks[rank] += 1
        self._decode_of[request_id] = (decode, rank)

    def view(self, rank: int, pages_needed: int, prefills: Sequence[int], decodes: Sequence[int],
             page_hashes: Sequence[bytes] = (), now: float | None = None, tokens: int = 0) -> LoadView:
        """The :class:`LoadView` of a request of tier ``rank`` with ``tokens`` prompt tokens needing
        ``pages_needed`` decode pages (full pages hashing to ``page_hashes``), among the ``prefills`` and ``decodes`` candidates
        (as :meth:`pick_prefill`, :meth:`pick_decode`), at ``now`` (``time.monotonic()`` seconds,
        default the present): looser requests that have aged to rank 0 by then count as ahead. Read-only.

        Raises:
            ValueError: a candidate list is empty.
        """
        prefill = self.pick_prefill(prefills, page_hashes, tokens)
        ahead, looser = PrefillWork(), PrefillWork()
        cut = min(max(rank, 0), NUM_RANKS - 1) + 1
        for i, work in enumerate(self.prefill_work[prefill]):
            (ahead if i < cut else looser).include(work)
        now = time.monotonic() if now is None else now
        for request_id, ages_at in self._ages_at[prefill].items():
            _, tokens, its_rank, images = self._prefill_of[request_id]
            if its_rank >= cut and ages_at <= now:  # served as rank 0 now: ahead of any new request
                looser.add(-1, tokens, images)
                ahead.add(1, tokens, images)
        running, elapsed = self._running(prefill, cut, ahead, looser, now)
        decode = self.pick_decode(pages_needed, decodes)
        load = self.decode[decode]
        cached = self.cached_tokens(prefill, page_hashes) // self.page_size if page_hashes else 0
        promises = self._promises(prefill, cut - 1, now) if running is not None else ()
        return LoadView(prefill, ahead, decode, load.running + len(load.inflight), load.pages_used,
                        load.tightest_rank(), cached, looser=looser, running=running, running_elapsed_s=elapsed,
                        recent=self._recent(prefill, now), promises=promises)

    def _promises(self, prefill: int, rank: int, now: float) -> tuple[Promise, ...]:
        """The :class:`Promise` of each request queued on ``prefill`` (not in its batch in progress)
        of a rank looser than ``rank``, dispatched with its arrival time and not aged by ``now``:
        the work served before it is the queued work of tighter ranks (aged requests count as rank
        0) and of its own rank dispatched before it (the prefill queue orders by rank, then arrival)."""
        arrived = self._arrived_at[prefill]
        if not arrived:
            return ()
        batch = self._batch[prefill]
        in_batch = batch[0] if batch is not None else set()
        queued = [(request_id, 0 if self._aged(prefill, request_id, now) else its_rank, tokens, images)
                  for request_id, (worker, tokens, its_rank, images) in self._prefill_of.items()
                  if worker == prefill and request_id not in in_batch]
        by_rank = [PrefillWork() for _ in range(NUM_RANKS)]
        for _, served_as, tokens, images in queued:
            by_rank[served_as].add(1, tokens, images)
        so_far = [PrefillWork() for _ in range(NUM_RANKS)]  # of each rank, dispatched up to the one at hand
        promises = []
        for request_id, served_as, tokens, images in queued:
            so_far[served_as].add(1, tokens, images)
            if served_as > rank and request_id in arrived:
                through = PrefillWork()
                for work in [*by_rank[:served_as], so_far[served_as]]:
                    through.include(work)
                promises.append(Promise(served_as, arrived[request_id], through))
        return tuple(promises)

    def _aged(self, prefill: int, request_id: str, now: float) -> bool:
        """Whether ``request_id``, queued on ``prefill``, is served as rank 0 by ``now`` (ageing)."""
        ages_at = self._ages_at[prefill].get(request_id)
        return ages_at is not None and ages_at <= now

    def _recent(self, prefill: int, now: float) -> PrefillWork:
        """The work dispatched to ``prefill`` in the :data:`ARRIVAL_WINDOW_S` seconds before ``now``."""
        log, work = self._dispatches[prefill], self._dispatched_work[prefill]
        while log and log[0][0] < now - ARRIVAL_WINDOW_S:
            _, tokens, images = log.popleft()
            work.add(-1, tokens, images)
        return PrefillWork(work.requests, work.tokens, work.images)

    def _running(self, prefill: int, cut: int, ahead: PrefillWork, looser: PrefillWork,
                 now: float) -> tuple[PrefillWork | None, float]:
        """(work, seconds since it started) of the batch in progress on ``prefill``, moved out of
        ``ahead`` and ``looser`` (ranks below ``cut`` and aged requests are in ``ahead``); (None, 0)
        when the worker does not report its batches."""
        batch = self._batch[prefill]
        if batch is None:
            return None, 0.0
        running = PrefillWork()
        for request_id in batch[0]:
            entry = self._prefill_of.get(request_id)
            if entry is None:
                continue
            _, tokens, its_rank, images = entry
            (ahead if its_rank < cut or self._aged(prefill, request_id, now) else looser).add(-1, tokens, images)
            running.add(1, tokens, images)
        return running, (max(0.0, now - batch[1]) if running.requests else 0.0)

    def batch_started(self, prefill: int, request_ids: Sequence[str], now: float | None = None) -> None:
        """Prefill worker ``prefill`` started a batch of ``request_ids`` at ``now`` (``time.monotonic()``
        seconds, default the present): until their first tokens come back, :meth:`view` counts
        them as in progress there, not as queued."""
        ids = {i for i in request_ids if i in self._prefill_of}
        self._batch[prefill] = (ids, time.monotonic() if now is None else now)

    def queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) dispatched to prefill workers and not yet prefilled."""
        return len(self._prefill_of), sum(self.prefill_tokens)

    def prefilled(self, request_id: str) -> None:
        """The first token came back: the request left its prefill queue."""
        entry = self._prefill_of.pop(request_id, None)
        if entry is not None:
            worker, tokens, rank, images = entry
            self._ages_at[worker].pop(request_id, None)
            self._arrived_at[worker].pop(request_id, None)
            batch = self._batch[worker]
            if batch is not None:
                batch[0].discard(request_id)
            self.prefill_tokens[worker] -= tokens
            self.prefill_work[worker][rank].add(-1, tokens, images)

    def claimed(self, request_id: str) -> None:
        """The decode worker reported the request (its pages now count in the worker's stats)."""
        entry = self._decode_of.get(request_id)
        if entry is not None:
            self.decode[entry[0]].inflight.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        self.prefilled(request_id)
        self.claimed(request_id)
        entry = self._decode_of.pop(request_id, None)
        if entry is not None:
            decode, rank = entry
            self.decode[decode].ranks[rank] -= 1

    def decode_of(self, request_id: str) -> int | None:
        entry = self._decode_of.get(request_id)
        return None if entry is None else entry[0]

    def prefill_of(self, request_id: str) -> int | None:
        entry = self._prefill_of.get(request_id)
        return None if entry is None else entry[0]

    def reset_prefill(self, index: int) -> None:
        """Prefill worker ``index`` failed: its prefix and encoder caches are gone with it, and its batch in progress."""
        self.prefixes.forget(index)
        if self.encoded is not None:
            self.encoded.forget(index)
        if self._batch[index] is not None:
            self._batch[index] = (set(), time.monotonic())

    def reset_decode(self, index: int) -> None:
        """Decode worker ``index`` failed: forget its last stats (its restart reports afresh)."""
        load = self.decode[index]
        load.pages_used = load.running = 0

    def update_decode_stats(self, index: int, pages_used: int, pages_total: int, running: int) -> None:
        load = self.decode[index]
        load.pages_used, load.pages_total, load.running = pages_used, pages_total, running
