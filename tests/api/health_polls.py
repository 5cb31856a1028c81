"""/health polled from a process of its own while a test loads the server: its latencies are the server's, not
those of the test's process (whose other threads, sending a 60 MB body or reading streams, and whose collector,
walking everything the suite has made, would hold its GIL)."""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import httpx

INTERVAL_S = 0.02


def _poll(url: str, stop: Event, out: Connection) -> None:
    latencies: list[float] = []
    statuses: set[int] = set()
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            statuses.add(client.get("/health").status_code)
            latencies.append(time.perf_counter() - start)
            if len(latencies) == 1:
                out.send("polling")
            time.sleep(INTERVAL_S)
    out.send((latencies, sorted(statuses)))


class HealthPolls:
    """``with HealthPolls(url) as polls:`` polls ``/health`` every 20 ms on one kept-alive connection from a
    spawned process until the block ends; then ``polls.latencies`` (seconds, in order) and ``polls.statuses``."""

    def __init__(self, url: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._ours, theirs = context.Pipe(duplex=False)
        self._process = context.Process(target=_poll, args=(url, self._stop, theirs), daemon=True)
        self._theirs = theirs
        self.latencies: list[float] = []
        self.statuses: list[int] = []

    def __enter__(self) -> HealthPolls:
        """Start the poller and return once its first poll is answered.

        Raises:
            RuntimeError: no poll answered within 30 s.
        """
        self._process.start()
        self._theirs.close()
        if not self._ours.poll(30) or self._ours.recv() != "polling":
            self.__exit__()
            raise RuntimeError("the /health poller did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ours.poll(30):
            self.latencies, self.statuses = self._ours.recv()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._ours.close()
