"""Goodput over repeated sweeps: median and range per system, and the ratio of medians.

One goodput search on a shared 2-core machine moves by tens of percent from run to
run, so ``mm-serve bench --repeat K`` runs every system's sweep K times, alternating
systems (A, B, A, B, ...: a slow spell of the machine hits both), and reports each
system's median goodput with its range, and the ratio of the first system's median to
each other one's, with the range of the round-by-round ratios.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RepeatedGoodput:
    """One system's goodputs (requests/s), one per round in round order."""

    name: str
    goodputs: tuple[float, ...]

    @property
    def median(self) -> float:
        """Median goodput, requests/s."""
        return statistics.median(self.goodputs)

    @property
    def low(self) -> float:
        """Lowest goodput of the rounds, requests/s."""
        return min(self.goodputs)

    @property
    def high(self) -> float:
        """Highest goodput of the rounds, requests/s."""
        return max(self.goodputs)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: the rounds' goodputs, median, low and high (requests/s)."""
        return {"name": self.name, "goodputs": list(self.goodputs), "median": self.median,
                "low": self.low, "high": self.high}


def group_goodputs(swept: Sequence[tuple[str, float]]) -> list[RepeatedGoodput]:
    """``(system, goodput)`` pairs in measuring order, grouped by system (first-seen order)."""
    by_name: dict[str, list[float]] = {}
    for name, goodput in swept:
        by_name.setdefault(name, []).append(goodput)
    return [RepeatedGoodput(name, tuple(values)) for name, values in by_name.items()]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def median_ratio(first: RepeatedGoodput, other: RepeatedGoodput) -> float:
    """``first``'s median goodput over ``other``'s (inf over 0)."""
    return _ratio(first.median, other.median)


def round_ratios(first: RepeatedGoodput, other: RepeatedGoodput) -> list[float]:
    """The ratio in each round both systems completed (round i of one over round i of the other)."""
    return [_ratio(a, b) for a, b in zip(first.goodputs, other.goodputs, strict=False)]


def format_repeated(groups: Sequence[RepeatedGoodput]) -> list[str]:
    """Lines: each system's goodput (median [range] and the rounds when repeated), then the ratios."""
    lines = []
    for g in groups:
        if len(g.goodputs) == 1:
            lines.append(f"  {g.name:<16} {g.median:8.3f} req/s")
        else:
            rounds = ", ".join(f"{x:.3f}" for x in g.goodputs)
            lines.append(f"  {g.name:<16} {g.median:8.3f} req/s median [{g.low:.3f}-{g.high:.3f}] "
                         f"over {len(g.goodputs)} rounds: {rounds}")
    for other in groups[1:]:
        line = f"  ratio {groups[0].name} / {other.name}: {median_ratio(groups[0], other):.2f}x"
        ratios = round_ratios(groups[0], other)
        if len(ratios) > 1:
            line += f" (of the medians; round by round {min(ratios):.2f}-{max(ratios):.2f}x)"
        lines.append(line)
    return lines
