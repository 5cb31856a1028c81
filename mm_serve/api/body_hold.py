"""The bytes a request body holds in the image budget while it is read, and each client's share
of bytes held before they arrive (:class:`~mm_serve.api.body_limit.BodyLimitMiddleware`)."""

from __future__ import annotations

import threading

from mm_serve.admission.byte_budget import ByteBudget


class BodyHold:
    """The bytes one request's body holds in a :class:`ByteBudget` (none without a budget)."""

    def __init__(self, budget: ByteBudget | None) -> None:
        self.budget = budget
        self.held = 0
        self.ahead = 0  # of the held bytes, those held before they arrived (from the Content-Length)
        self._lock = threading.Lock()

    def add_now(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more if they fit now, ahead of the calls waiting (a body partly held must not wait
        behind them: they may be waiting for what it holds); the total capped at the budget's capacity.
        False when they do not fit."""
        more = self._more(nbytes)
        if more and self.budget is not None and not self.budget.try_reserve(more):
            return False
        self._took(more)
        return True

    async def add_waiting(self, nbytes: int, wait_s: float) -> bool:
        """Hold ``nbytes`` more (the total capped at the budget's capacity, so a body larger than it passes
        alone), waiting up to ``wait_s`` seconds for room behind the calls that came first; False when they
        did not fit in time."""
        more = self._more(nbytes)
        if more and self.budget is not None and not await self.budget.reserve_waiting(more, wait_s):
            return False
        self._took(more)
        return True

    def _more(self, nbytes: int) -> int:
        """Of ``nbytes`` more, what the budget must hold: the total capped at its capacity (0 without a budget)."""
        return 0 if self.budget is None else max(0, min(nbytes, self.budget.capacity - self.held))

    def _took(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes

    def release(self) -> None:
        """Give the held bytes back (once; later calls do nothing)."""
        with self._lock:
            held, self.held = self.held, 0
        if held and self.budget is not None:
            self.budget.release(held)


class AheadByClient:
    """Per client address, the bytes its bodies hold in the budget before they have arrived (on the
    event loop only)."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = {}

    def take(self, client: str, nbytes: int, cap: int) -> int:
        """Let ``client`` hold ``nbytes`` ahead if its total stays within ``cap``: returns ``nbytes``,
        or 0 (its body is then held as it arrives)."""
        now = self._bytes.get(client, 0)
        if now + nbytes > cap:
            return 0
        self._bytes[client] = now + nbytes
        return nbytes

    def give(self, client: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        left = self._bytes.get(client, 0) - nbytes
        if left > 0:
            self._bytes[client] = left
        else:
            self._bytes.pop(client, None)
