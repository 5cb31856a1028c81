"""Routing: which prefill and which decode worker a request goes to (xPyD).

* Prefill: with ``cache_aware`` routing (the default; SGLang's ``cache_aware`` policy is the
  reference), the worker believed to hold the longest cached prefix of the request
  (:class:`~mm_serve.engine.prefix_index.PrefixIndex`: its hits on the images of that prefix too),
  unless its queued work exceeds the least-queued worker's by more than ``balance_tokens``;
  otherwise, and with ``least_queued`` routing, the worker with the least queued work. Queued
  work (the :class:`~mm_serve.engine.load_ledger.LoadLedger`'s count: prompt tokens left to
  compute) has the request's own tokens added and is weighed by each worker's speed
  (:meth:`Router.set_prefill_speed`: a worker that shares its core with a decode worker runs its
  batches slower, and an equal share of tokens would make it the bottleneck): the worker that
  would finish the request first. Keeping a conversation on one worker keeps its later turns'
  hits there too.
* Decode: the worker with room, judged from its latest stats (free pages, running count) minus
  what was dispatched to it since: the one with the most free pages after its in-flight
  requests, among those under ``decode_max_concurrent``; if none has room, the least loaded
  (the hand-off then waits in its ring, which is backpressure, never a drop).

Only workers the caller names as candidates (the ready ones) are picked: a worker
that is restarting or down gets nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.load_view import Route
from mm_serve.engine.prefix_index import PrefixIndex


class Router:
    """Chooses workers from the loads in ``ledger`` and its own picture of each prefill worker's caches.

    Args:
        ledger: the work dispatched so far (read here; the caller keeps it).
        max_running: ``decode_max_concurrent``: a decode worker with this many requests has no room.
        cache_aware: route by cached prefix (``balance_tokens`` queued tokens of slack),
            remembering up to ``prefill_pages`` page hashes (of ``page_size`` tokens) per prefill worker.
        encoder_images: images each prefill worker's encoder cache holds (0: none, every image is
            encoded), remembered by content hash so an image sent there lately is no image to
            encode (:meth:`images_to_encode`).
    """

    def __init__(self, ledger: LoadLedger, max_running: int, cache_aware: bool = False, balance_tokens: int = 2048,
                 prefill_pages: int = 2048, page_size: int = 16, encoder_images: int = 0) -> None:
        num_prefill = len(ledger.prefill)
        self.ledger = ledger
        self.cache_aware = cache_aware
        self.page_size = page_size
        self.balance_tokens = balance_tokens
        self.prefixes = PrefixIndex(num_prefill, prefill_pages)
        self.encoded = PrefixIndex(num_prefill, encoder_images) if encoder_images > 0 else None
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
        return (self.ledger.prefill[worker].queued_tokens + tokens) * self.prefill_speed[worker]

    def pick_prefill(self, candidates: Sequence[int] | None = None, page_hashes: Sequence[bytes] = (),
                     tokens: int = 0) -> int:
        """Index of the prefill worker for a request of ``tokens`` prompt tokens whose full pages
        hash to ``page_hashes``, among ``candidates`` (default: all): see the module docstring;
        the least queued work plus its own at each worker's speed, lowest index on ties, when no
        candidate holds a prefix or routing is not cache-aware.

        Raises:
            ValueError: ``candidates`` is empty.
        """
        pool = range(len(self.prefill_speed)) if candidates is None else candidates
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
        decode = self.ledger.decode

        def room(i: int) -> tuple[bool, int, int]:
            load = decode[i]
            busy = load.running + len(load.inflight)
            fits = busy < self.max_running and load.free_after_inflight() >= pages_needed
            return (fits, load.free_after_inflight(), -busy)

        return max(range(len(decode)) if candidates is None else candidates, key=room)

    def route(self, pages_needed: int, prefills: Sequence[int], decodes: Sequence[int],
              page_hashes: Sequence[bytes] = (), tokens: int = 0) -> Route:
        """The :class:`Route` of a request of ``tokens`` prompt tokens (full pages hashing to
        ``page_hashes``) needing ``pages_needed`` decode pages, among the ``prefills`` and ``decodes``
        candidates (as :meth:`pick_prefill` and :meth:`pick_decode`). Read-only.

        Raises:
            ValueError: a candidate list is empty.
        """
        prefill = self.pick_prefill(prefills, page_hashes, tokens)
        cached = self.cached_tokens(prefill, page_hashes) // self.page_size if page_hashes else 0
        return Route(prefill, self.pick_decode(pages_needed, decodes), cached)

    def images_to_encode(self, worker: int, image_hashes: Sequence[bytes]) -> list[bool]:
        """For each image (by content hash), whether prefill worker ``worker`` would run the vision
        tower on it: not in its encoder cache as far as the router knows, and not an earlier
        image of the same request (all True without an encoder cache)."""
        held = self.encoded.held(worker, image_hashes) if self.encoded is not None else [False] * len(image_hashes)
        return [not h and digest not in image_hashes[:i] for i, (h, digest) in enumerate(zip(held, image_hashes, strict=True))]

    def work_left(self, prefill: int, tokens: int, images: int, page_hashes: Sequence[bytes] = (),
                  image_hashes: Sequence[bytes] = (), tiles: Sequence[int] = ()) -> tuple[int, int]:
        """(prompt tokens, tower passes) that prefill worker ``prefill`` must compute for a request
        sent to it now with ``tokens`` tokens and ``images`` images of ``tiles`` tower passes each
        (empty: one each): its believed-cached prefix and the images held in its encoder cache (by
        ``image_hashes``, one per image) left out, at least the last token counted. From now on the
        worker is believed to hold the request's pages and images."""
        passes = list(tiles) if len(tiles) == images else [1] * images
        if self.encoded is not None and len(image_hashes) == images:
            encode = self.images_to_encode(prefill, image_hashes)
            passes = [n for n, fresh in zip(passes, encode, strict=True) if fresh]
            self.encoded.record(prefill, image_hashes)
        images = sum(passes)
        if self.cache_aware and page_hashes:
            tokens -= min(self.cached_tokens(prefill, page_hashes), tokens - 1)
            self.prefixes.record(prefill, page_hashes)
        return tokens, images

    def forget_prefill(self, index: int) -> None:
        """Prefill worker ``index`` failed: its prefix and encoder caches are gone with it."""
        self.prefixes.forget(index)
        if self.encoded is not None:
            self.encoded.forget(index)
