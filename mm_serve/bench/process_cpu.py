"""Where the cores go: CPU seconds per process over a run, per delivered token, and py-spy's top functions.

A serving benchmark on a small machine measures the benchmark client too: it shares
the cores with the server. :func:`cpu_seconds` reads each named process's user + system
CPU time (``psutil``; children that exited are not counted), :func:`cpu_table` turns two
readings and the tokens delivered in between into CPU milliseconds per output token by
process, and :func:`top_functions` reads py-spy's ``--format raw`` output (collapsed
stacks, one ``frame;frame;... count`` line per distinct stack) into the functions with
the most samples on top of the stack (self time) and anywhere in it (inclusive time).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each named process; a process that is gone (a worker
    restarted under another pid, say) is left out, so that :func:`cpu_table` can say so."""
    import psutil

    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[name] = times.user + times.system
    return out


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``: pid -> its command line (shortened)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for child in children:
        try:
            out[child.pid] = " ".join(child.cmdline())[:80]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@dataclass(frozen=True)
class CpuRow:
    """One process's CPU over a run: seconds, milliseconds per output token, share of the total (0..1)."""

    name: str
    cpu_s: float
    ms_per_token: float
    share: float


def cpu_table(before: Mapping[str, float], after: Mapping[str, float], tokens: int,
              measuring: frozenset[str] = frozenset()) -> list[CpuRow]:
    """Rows for the processes read at both ends (largest first), then ``server total`` (all but
    the ``measuring`` ones: the benchmark client, profilers) and ``total``.

    Raises:
        ValueError: ``tokens`` < 1 (nothing delivered: no per-token figure), or a process read
            before is missing after (it exited during the run: its CPU would be lost).
    """
    if tokens < 1:
        raise ValueError(f"no output tokens were delivered ({tokens}); nothing to divide by")
    gone = sorted(set(before) - set(after))
    if gone:
        raise ValueError(f"{', '.join(gone)} exited during the run (restarted?): its CPU time is lost; run again")
    spent = {name: max(0.0, after[name] - before[name]) for name in before}
    total = sum(spent.values())
    server = sum(s for name, s in spent.items() if name not in measuring)

    def row(name: str, s: float) -> CpuRow:
        return CpuRow(name, s, 1e3 * s / tokens, s / total if total > 0 else 0.0)

    rows = [row(name, s) for name, s in sorted(spent.items(), key=lambda kv: -kv[1])]
    return [*rows, row("server total", server), row("total", total)]


def format_cpu_table(rows: list[CpuRow], wall_s: float) -> str:
    """The table: CPU s, ms per token, share, and cores busy on average over ``wall_s`` seconds."""
    lines = [f"{'process':<18} {'CPU s':>8} {'ms/token':>9} {'share':>6} {'cores':>6}"]
    for r in rows:
        cores = r.cpu_s / wall_s if wall_s > 0 else float("nan")
        lines.append(f"{r.name:<18} {r.cpu_s:>8.2f} {r.ms_per_token:>9.3f} {100 * r.share:>5.1f}% {cores:>6.2f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class FunctionShare:
    """A function (``name (file)``) and its share (0..1) of a process's samples."""

    function: str
    self_share: float  # samples with it on top of the stack
    inclusive_share: float  # samples with it anywhere in the stack


def _function(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one entry per function, not per line."""
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    return f"{m['func']} ({Path(m['file']).name})"


def top_functions(raw: str, n: int = 15) -> tuple[int, list[FunctionShare]]:
    """The total samples and the ``n`` functions with the most self samples in py-spy raw output."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        count = int(m["count"])
        frames = [_function(f) for f in m["stack"].split(";") if f.strip()]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for func in set(frames):
            anywhere[func] += count
    if total == 0:
        return 0, []
    return total, [FunctionShare(f, c / total, anywhere[f] / total) for f, c in own.most_common(n)]
