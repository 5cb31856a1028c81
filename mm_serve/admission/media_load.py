"""How long a call's media work still has to run, from the media work in flight in the API process.

The API process fetches, decodes and preprocesses images (and templates and tokenizes prompts) on a
few threads that share the cores with the workers; under a burst the calls in that phase finish in
roughly the order they started. Each call brings its :class:`MediaWork`: its prompts and the
megapixels of its images (declared in their headers). What the phase costs is fitted online as

    seconds ≈ a · prompts + b · megapixels

from each call that leaves it, against the busy time that passed since the previous call left (or
since the phase last went from empty to busy): the union of the calls' stays, shared out in the order
they leave, so calls processed together count their shared time once, and calls that come one at a
time with pauses between them are timed by their stays, not by the rate they come at (Little's law
over work; Little 1961). Two terms, because the two parts do not scale together: a burst of small
images measures the per-call part (templating, tokenizing, waiting for the event loop: ~10 ms each
under a burst, 0.05 MP of pixels), and priced by their megapixels alone it put a 12 MP photo at 10 s
behind three others (they took 1 s). The fit (:class:`~mm_serve.admission.online_fit.OnlineLinearFit`,
θ ≥ 0, the last ~20 calls) starts from :data:`START_SECONDS` and keeps its pull toward it, so a term
the recent calls say little about (no large image lately) stays near its start.

Only calls whose images were sent in the request (data: URIs, their sizes declared in their
headers) teach the fit: a fetched image's stay holds the wait for its host (and its size, unknown
until fetched, is priced at :data:`~mm_serve.pipeline.gate.UNDECLARED_IMAGE_MEGAPIXELS`): learned,
three 3 s fetches would make the per-call part 0.6 s and refuse text calls. A call that waited for the
image byte budget is not learned from either.

The time a call still has to wait is then the fit's price of its own work and of the calls in the
phase ahead of it in the line of the media threads (:mod:`mm_serve.media.media_runner`: a lower rank,
or the same rank and entered before it), shared by the ``lanes`` threads; a call outside that line
(no image: its prompts are tokenized apart) waits for no one. The threads run in parallel on at most
``os.cpu_count()`` cores: more threads than cores share them. Before any call has left the phase since
start, it is priced by a lower bound from the oldest call in the phase instead: that one has run for
its whole time so far without finishing, first in the threads' line, so the work ahead takes at least
that time per the oldest call's price. Never less than the time the call has already spent there.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass

from mm_serve.admission.online_fit import OnlineLinearFit

START_SECONDS = (0.002, 0.015)  # per prompt, per megapixel: a quiet 2-core CPU (2 ms a call, a 12 MP JPEG 0.18 s)
FIT_SCALES = (1.0, 4.0)  # a typical call: one prompt, a 4 MP photo


@dataclass(frozen=True)
class MediaWork:
    """A call's media work: its prompts (templated and tokenized) and its images' megapixels
    (decoded and preprocessed; a video's at its sampled frames' largest). ``known``: the megapixels are
    those of its images as declared in their data (data: URIs), so its stay measures this work; a call
    that fetches an image (its size unknown until fetched, the wait for the host in its stay) or
    samples a video (priced at its largest) is priced, not learned from.

    Raises:
        ValueError: fewer than one prompt, or negative megapixels.
    """

    prompts: int = 1
    megapixels: float = 0.0
    known: bool = True

    def __post_init__(self) -> None:
        if self.prompts < 1 or not self.megapixels >= 0:
            raise ValueError(f"media work needs at least one prompt and megapixels >= 0, got {self}")

    @property
    def features(self) -> tuple[float, float]:
        """(prompts, megapixels): what the fit prices."""
        return self.prompts, self.megapixels


class MediaLoad:
    """The calls in their media phase (by ticket, in the order they entered, with their work) and
    the fit of what the phase costs. Thread-safe; times are ``time.monotonic()`` seconds."""

    def __init__(self, cores: int | None = None, lanes: int = 1) -> None:
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        # ticket -> (entered at, work, rank in the media threads' line or None); in ticket order
        self._running: dict[int, tuple[float, MediaWork, int | None]] = {}
        self._last_left: float | None = None  # when a call last left the phase
        self.fit = OnlineLinearFit(START_SECONDS, FIT_SCALES)
        self._lanes = max(1, min(lanes, cores or os.cpu_count() or 1))  # threads that run at once

    def enter(self, work: MediaWork, now: float | None = None, rank: int | None = 0) -> int:
        """A call of ``work`` starts its media work, at ``rank`` in the media threads' line (None: not in
        it); returns its ticket."""
        with self._lock:
            ticket = next(self._tickets)
            self._running[ticket] = (time.monotonic() if now is None else now, work, rank)
            return ticket

    def leave(self, ticket: int, now: float | None = None, learn: bool = True) -> None:
        """The call of ``ticket`` is done with its media work (finished, failed or cancelled): the
        fit learns its work against the busy time since the previous call left, unless its work is
        not :attr:`MediaWork.known` or ``learn`` is False (it waited for something else than work:
        the image byte budget); that time is then dropped, not passed on to the next call."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if ticket not in self._running:
                return
            busy_since = min(entered for entered, _, _ in self._running.values())  # the phase is busy from then on
            _, work, _ = self._running.pop(ticket)
            if self._last_left is not None:
                busy_since = max(busy_since, self._last_left)
            self._last_left = max(now, self._last_left or now)
            if learn and work.known:
                self.fit.observe(work.features, max(0.0, now - busy_since))

    def in_flight(self) -> int:
        """Calls in their media phase now."""
        with self._lock:
            return len(self._running)

    def report(self) -> dict[str, object]:
        """The fit's coefficients (seconds per prompt, per megapixel) and observations, and the calls
        in the phase now (for /health)."""
        with self._lock:
            per_prompt, per_megapixel = self.fit.coefficients
            return {"s_per_prompt": per_prompt, "s_per_megapixel": per_megapixel,
                    "observations": self.fit.num_observations, "in_flight": len(self._running)}

    def seconds(self, work: MediaWork) -> float:
        """The fit's price of ``work`` alone, in seconds."""
        with self._lock:
            return self.fit.predict(work.features)

    def expected_remaining(self, ticket: int, now: float | None = None, in_line: bool = True) -> float:
        """Seconds the call of ``ticket`` is expected to spend in its media phase from ``now`` (see
        the module's text); 0.0 for a ticket that is not running. ``in_line`` False: the call still waits
        for its image bytes, which the calls with images that entered before it hold (first come, first
        served) until their work is done: all of those are ahead of it, whatever their rank."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entry = self._running.get(ticket)
            if entry is None:
                return 0.0
            entered, own, rank = entry
            spent = max(0.0, now - entered)
            others = 0.0 if rank is None else sum(
                self.fit.predict(work.features) for t, (_, work, r) in self._running.items()
                if t != ticket and r is not None and ((r, t) < (rank, ticket) or (not in_line and t < ticket)))
            ahead = self.fit.predict(own.features) + others / self._lanes
            if self.fit.num_observations:
                return max(spent, ahead)
            # nothing measured since start: the oldest call has run all this time without finishing
            oldest_at, oldest, _ = next(iter(self._running.values()))
            slowdown = max(now - oldest_at, 1e-3) / max(self.fit.predict(oldest.features), 1e-9)  # its time over its price
            return max(spent, ahead * slowdown)
