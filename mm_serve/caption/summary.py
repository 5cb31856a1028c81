"""Counts and timings of a caption job, and the summary printed at its end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mm_serve.bench.metrics import percentile
from mm_serve.caption.records import Outcome


@dataclass
class JobStats:
    """What a job did.

    Attributes:
        total: inputs in INPUT.
        skipped: inputs already done in OUT before this run (not run again).
        succeeded: inputs that got a caption (or a 200 response) in this run.
        failed: inputs that got an error row in this run.
        latencies_s: per-input latency of the successes, in seconds.
        wall_s: seconds from the first submission to the last row written.
        interrupted: the job was stopped by a signal (Ctrl-C, SIGTERM).
        fatal_error: why the job stopped early when the service went away, else None.
    """

    total: int
    skipped: int = 0
    succeeded: int = 0
    failed: int = 0
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: bool = False
    fatal_error: str | None = None

    def add(self, outcome: Outcome) -> None:
        """Count one finished input."""
        if outcome.ok:
            self.succeeded += 1
            self.latencies_s.append(outcome.latency_s)
        else:
            self.failed += 1

    @property
    def finished(self) -> int:
        """Inputs that got a row in this run."""
        return self.succeeded + self.failed

    @property
    def remaining(self) -> int:
        """Inputs with no row yet (non-zero after an interruption or a fatal error)."""
        return self.total - self.skipped - self.finished

    @property
    def images_per_s(self) -> float:
        """Rows written per second of wall time (0 when nothing ran)."""
        return self.finished / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain values (latencies as p50/p99, in seconds) for JSON or tests."""
        return {
            "total": self.total, "skipped": self.skipped, "succeeded": self.succeeded, "failed": self.failed,
            "remaining": self.remaining, "wall_s": round(self.wall_s, 3),
            "images_per_s": round(self.images_per_s, 3),
            "latency_p50_s": round(percentile(self.latencies_s, 50), 4) if self.latencies_s else None,
            "latency_p99_s": round(percentile(self.latencies_s, 99), 4) if self.latencies_s else None,
            "interrupted": self.interrupted, "fatal_error": self.fatal_error,
        }

    def format(self) -> str:
        """The human summary: counts, wall time, images/s, p50/p99 latency of the successes."""
        lines = [
            f"caption: {self.succeeded} succeeded, {self.failed} failed, {self.skipped} already done, "
            f"{self.remaining} remaining (of {self.total})",
            f"wall time {self.wall_s:.1f} s, {self.images_per_s:.2f} images/s",
        ]
        if self.latencies_s:
            lines[-1] += (f", latency p50 {percentile(self.latencies_s, 50):.2f} s, "
                          f"p99 {percentile(self.latencies_s, 99):.2f} s")
        if self.interrupted:
            lines.append("interrupted: every finished input is in the output; re-run the same command to finish")
        if self.fatal_error:
            lines.append(f"stopped: {self.fatal_error}; re-run the same command to finish")
        return "\n".join(lines)
