"""The job loop with a fake backend: window bound, output order, stop, fatal errors, summary."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from mm_serve.caption.backends import CaptionBackend, FatalBackendError
from mm_serve.caption.inputs import CaptionInput
from mm_serve.caption.output import OutputFile
from mm_serve.caption.records import Outcome, failure
from mm_serve.caption.runner import CaptionJob
from mm_serve.caption.summary import JobStats, percentile


class FakeBackend(CaptionBackend):
    """Sleeps ``delays[id]`` (else ``default``) seconds; ids in ``bad`` fail, ``fatal`` raises, ``boom`` has a bug."""

    def __init__(self, delays: dict[str, float], bad: frozenset[str] = frozenset(), fatal: str = "",
                 boom: str = "", default: float = 0.0) -> None:
        self.delays, self.bad, self.fatal, self.boom, self.default = delays, bad, fatal, boom, default
        self.in_flight = self.max_in_flight = 0
        self.cancelled: list[str] = []

    @property
    def default_concurrency(self) -> int:
        return 4

    async def run(self, item: CaptionInput) -> Outcome:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delays.get(item.id, self.default))
        except asyncio.CancelledError:
            self.cancelled.append(item.id)
            raise
        finally:
            self.in_flight -= 1
        if item.id == self.fatal:
            raise FatalBackendError("server went away")
        if item.id == self.boom:
            raise KeyError("a bug")
        if item.id in self.bad:
            return failure(0.01, "bad image")
        return Outcome(latency_s=self.delays.get(item.id, 0.0), caption=f"caption of {item.id}")

    async def aclose(self) -> None:
        return None


def _items(n: int) -> list[CaptionInput]:
    return [CaptionInput(f"i{k}", None, f"/x/i{k}.png", "p") for k in range(n)]


def _run(tmp_path: Path, backend: FakeBackend, n: int, *, stop_after: float | None = None,
         **kwargs: object) -> tuple[JobStats, list[dict]]:
    out, _ = OutputFile.open(tmp_path / "out.jsonl", "folder")

    async def go() -> JobStats:
        stop = asyncio.Event()
        if stop_after is not None:
            asyncio.get_running_loop().call_later(stop_after, stop.set)
        return await CaptionJob(_items(n), "folder", backend, out, **kwargs).run(stop)  # type: ignore[arg-type]

    stats = asyncio.run(go())
    out.close()
    return stats, [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_window_is_bounded_and_rows_come_as_they_finish(tmp_path: Path) -> None:
    delays = {f"i{k}": 0.05 * (6 - k) for k in range(6)}  # later inputs finish first
    backend = FakeBackend(delays, bad=frozenset({"i2"}))
    stats, rows = _run(tmp_path, backend, 6, concurrency=6)
    assert backend.max_in_flight == 6
    assert [r["id"] for r in rows] == ["i5", "i4", "i3", "i2", "i1", "i0"]
    assert rows[3] == {"id": "i2", "path": None, "error": "bad image"}
    assert (stats.succeeded, stats.failed, stats.remaining) == (5, 1, 0)


def test_in_order_holds_rows_back(tmp_path: Path) -> None:
    delays = {f"i{k}": 0.02 * (5 - k) for k in range(5)}
    backend = FakeBackend(delays)
    _, rows = _run(tmp_path, backend, 5, concurrency=2, in_order=True)
    assert backend.max_in_flight == 2
    assert [r["id"] for r in rows] == [f"i{k}" for k in range(5)]


def test_stop_cancels_in_flight_and_keeps_finished_rows(tmp_path: Path) -> None:
    backend = FakeBackend({"i0": 0.01, "i2": 0.02}, default=5.0)
    stats, rows = _run(tmp_path, backend, 6, concurrency=4, in_order=True, stop_after=0.3)
    assert stats.interrupted and stats.remaining == 4
    assert [r["id"] for r in rows] == ["i0", "i2"]  # i2 was held back behind i1, written at the stop
    assert sorted(backend.cancelled) == ["i1", "i3", "i4", "i5"]


def test_fatal_error_stops_the_job_without_a_row(tmp_path: Path) -> None:
    backend = FakeBackend({"i0": 0.0, "i1": 0.05}, fatal="i1", default=5.0)
    stats, rows = _run(tmp_path, backend, 5, concurrency=3)
    assert stats.fatal_error == "server went away"
    assert [r["id"] for r in rows] == ["i0"]
    assert sorted(backend.cancelled) == ["i2", "i3"] and stats.remaining == 4


def test_a_bug_costs_one_error_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats, rows = _run(tmp_path, FakeBackend({}, boom="i1"), 3, concurrency=2)
    assert (stats.succeeded, stats.failed) == (2, 1)
    assert next(r for r in rows if r["id"] == "i1")["error"] == "internal error: KeyError: 'a bug'"
    assert "KeyError" in capsys.readouterr().err


def test_summary_figures() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert math.isnan(percentile([], 50))
    stats = JobStats(total=10, skipped=2, succeeded=6, failed=1, latencies_s=[1.0, 2.0], wall_s=2.0)
    assert stats.images_per_s == 3.5 and stats.remaining == 1
    text = stats.format()
    assert "6 succeeded, 1 failed, 2 already done, 1 remaining (of 10)" in text
    assert "3.50 images/s" in text and "p50 1.50 s" in text and "p99 1.99 s" in text
    assert stats.to_dict()["latency_p99_s"] == 1.99
    with pytest.raises(ValueError, match="concurrency"):
        CaptionJob([], "folder", FakeBackend({}), None, concurrency=0)  # type: ignore[arg-type]
