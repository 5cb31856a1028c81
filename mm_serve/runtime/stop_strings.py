"""Stop strings found in streamed text at a cost that does not grow with how many there are.

An Aho-Corasick automaton (Aho and Corasick 1975, "Efficient string matching: an aid to bibliographic
search"; pyahocorasick's C implementation) over the stop strings finds every occurrence of any of them
in one pass over a text, in time linear in the text plus the occurrences. The detokenizer scans only the
window a new step can complete a stop in (the new text and the longest stop string's length before it),
so a step costs the same with 1 stop string or 1,000. Held text follows vLLM's rule: the last
``longest - 1`` characters are not sent until a later step (or the end) shows they start no stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """An automaton over ``stops`` (non-empty strings; duplicates count once, at their first place).

    Raises:
        ValueError: no stop string, or an empty one.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        import ahocorasick

        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be a non-empty list of non-empty strings")
        self.stops = tuple(stops)
        self.longest = max(len(s) for s in stops)
        self._automaton = ahocorasick.Automaton()
        for index, stop in enumerate(stops):
            if not self._automaton.exists(stop):
                self._automaton.add_word(stop, (index, stop))
        self._automaton.make_automaton()

    def first(self, text: str, start: int = 0, end_after: int = 0) -> tuple[int, str] | None:
        """The earliest occurrence of a stop string in ``text`` that starts at or after ``start`` and ends after
        character ``end_after`` (its last character at index ``end_after`` or later): (its start, the stop
        string; of several starting there, the first in the list); None when there is none.

        Cost: linear in ``len(text) - start`` plus the occurrences found.
        """
        best: tuple[int, int, str] | None = None
        for end, (index, stop) in self._automaton.iter(text, start):
            if end < end_after:
                continue
            at = end - len(stop) + 1
            if best is None or (at, index) < best[:2]:
                best = (at, index, stop)
        return None if best is None else (best[0], best[2])

    @property
    def hold(self) -> int:
        """Characters at the end of the text held back (they may begin a stop string): ``longest - 1``."""
        return self.longest - 1
