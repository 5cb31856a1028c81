"""uvicorn's server with a graceful drain on the first SIGTERM / SIGINT.

The first signal (to the API process, or to the whole process group: workers ignore
both) stops admitting, with the listener still open so that new requests get a clear
503 rather than a refused connection; in-flight requests have ``api.shutdown_grace_s``
seconds to finish; then the server exits as uvicorn does and the lifespan shutdown
stops every worker and unlinks every segment. A second signal ends the drain at once. Requests
still in flight when the drain ends (the grace passed, or the second signal) are failed first,
so each gets an answer (a stream's last event is a ``service_unavailable`` error, a call not yet
answered gets a 503) before the connections close. A third signal exits without waiting for
those answers. Before the workers have started (first start) there is nothing to drain, and the
first signal exits.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.ground.console import say


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first exit signal drains ``holder`` for up to ``grace_s`` seconds."""

    def __init__(self, config: uvicorn.Config, holder: EngineHolder, grace_s: float,
                 admitting: Callable[[], int] = lambda: 0) -> None:
        super().__init__(config)
        self._holder = holder
        self._grace_s = grace_s
        self._admitting = admitting  # calls being admitted, not yet submitted (the drain waits for them too)
        self._draining = False
        self._cut = False  # a second signal ended the drain

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without re-raising the exit signal once the server has stopped (uvicorn >= 0.29
        does, for its default handlers): here the signal was handled (drained, then stopped), and
        the CLI exits 0 after SIGTERM as after Ctrl-C, past its own last message."""
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining and not self._cut and not self._holder.drain_ended.is_set():  # a second signal: end the drain now (the drain thread fails what is left)
            self._cut = True
            self._holder.cut_drain()
            say("mm-serve: stopping now: requests in flight are answered 503 (signal again to exit without "
                "answering them)")
            return
        if self._draining:  # a third signal: exit without uvicorn's wait for open connections
            self.force_exit = True
            super().handle_exit(sig, frame)
            return
        if not self._holder.started:  # started: a restarting worker still drains
            super().handle_exit(sig, frame)
            return
        self._draining = True
        if self._grace_s > 0:
            say(f"mm-serve: stopping: new requests get 503, in-flight ones have {self._grace_s:g} s to finish "
                "(signal again to stop now)")
        threading.Thread(target=self._drain_then_exit, args=(sig, frame), name="mm-serve-drain", daemon=True).start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, and after a third signal (``force_exit``, where uvicorn skips it) the app's lifespan
        shutdown too: it stops the workers, which the CLI would do next anyway, and the lifespan task,
        cancelled by the loop's teardown instead, logged a CancelledError traceback."""
        await super().shutdown(sockets)
        if self.force_exit:
            await self.lifespan.shutdown()

    def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        left = self._holder.drain(self._grace_s, self._admitting)  # sets drain_ended: a later signal exits at once
        if left:
            why = "on a second signal" if self._cut else f"after {self._grace_s:g} s" if self._grace_s > 0 else "(no grace)"
            say(f"mm-serve: {left} request(s) still in flight {why}; stopping them")
        self._holder.fail_in_flight("the service stopped before this request finished; send it again")
        super().handle_exit(sig, frame)
