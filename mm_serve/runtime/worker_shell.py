"""The shell every worker process runs in: start-up, the control loop, stats, close.

Start-up reads as a story: pin cores and set threads → :meth:`WorkerShell.load` (model,
KV cache, schedulers: the role's own) → :meth:`WorkerShell.warm_up` → open the channel → :meth:`WorkerShell.serve`
reports ready and loops → :meth:`WorkerShell.close`. Each loop iteration reads every
pending control message (waiting up to :attr:`WorkerShell.idle_wait_ms` when the worker
is idle, not at all when it is busy, up to the next step when it paces its steps:
:meth:`WorkerShell.wait_ms`), runs one :meth:`WorkerShell.step`, and sends
:class:`~mm_serve.runtime.messages.WorkerStats` every ``spec.stats_interval_s``.

A role supplies only what differs: what it loads, how it accepts and aborts a request,
what one step does, its load figures for the stats, and (roles with rings) how it swaps
the ring of a restarted peer. The shell owns the channel and
the message dispatch (Abort / Stats / Shutdown, and requests for roles that take them).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from mm_serve.ground.console import say
from mm_serve.ground.roles import Role
from mm_serve.models.model_config import ModelConfig
from mm_serve.runtime import messages
from mm_serve.runtime.heap_freeze import freeze_startup_heap
from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.step_log import StepLog
from mm_serve.runtime.structured_output import GrammarBook
from mm_serve.runtime.worker_channel import IDLE_WAIT_MS, WorkerChannel
from mm_serve.runtime.worker_setup import pin_and_set_threads
from mm_serve.runtime.worker_spec import WorkerSpec
from mm_serve.transport.doorbell import DoorbellListener

if TYPE_CHECKING:
    from mm_serve.transport.ray_link import RayLink


class WorkerShell(ABC):
    """Base of the prefill, decode and colocated workers.

    Subclasses set :attr:`role` and :attr:`accepts` (the message union their channel
    decodes), and in :meth:`load` :attr:`kv_cache`, :attr:`model_config` and :attr:`grammars` (and
    :attr:`wake_on`, :attr:`idle_wait_ms` where they differ).
    """

    role: ClassVar[Role]
    accepts: ClassVar[Any] = messages.ToPrefill
    idle_wait_ms: int = IDLE_WAIT_MS  # longest wait for a message while idle (a doorbell ends it early)
    kv_cache: PagedKVCache
    model_config: ModelConfig
    grammars: GrammarBook  # the structured-output compiler, warmed in the background once the worker is ready
    wake_on: DoorbellListener | None = None  # a doorbell whose ring also ends the idle wait
    step_log: StepLog | None = None  # one JSON line per timed step, where MM_SERVE_STEP_LOG names a file

    def __init__(self, spec: WorkerSpec, link: RayLink | None = None) -> None:
        """``link``: set when the worker runs as a Ray actor (its rings over Ray meet the
        actor's methods there, :mod:`mm_serve.transport.ray_link`); None in a plain process."""
        self.spec = spec
        self.link = link
        pin_and_set_threads(spec)
        self.load()
        self.warm_up_error = ""
        try:
            self.warm_up()
        except Exception as exc:  # as before the pass existed: the first requests pay the lazy initialisation
            self.warm_up_error = repr(exc)
            say(f"[{self.role.value} {spec.index}] warm-up pass failed, serving without it: {exc!r}")
        self.channel = WorkerChannel(spec.control_address, spec.output_address, self.accepts, spec.parent_pid)
        if self.wake_on is not None:
            self.channel.listen_to(self.wake_on)
        self._next_stats = 0.0
        self.step_log = StepLog.from_env(self.role.value, spec.index)  # MM_SERVE_STEP_LOG (None: unset)

    # ---- what a role supplies ---------------------------------------------------------------

    @abstractmethod
    def load(self) -> None:
        """Load the model, size the KV cache (set :attr:`kv_cache`), build the schedulers."""

    def warm_up(self) -> None:
        """Run the role's passes once on throw-away inputs before reporting ready
        (:func:`mm_serve.runtime.warm_up.warm_up`; default: nothing)."""
        return None

    def accept(self, msg: messages.PrefillRequest) -> None:
        """Queue a new request (roles whose :attr:`accepts` includes ``PrefillRequest``)."""
        raise NotImplementedError(f"a {self.role} worker takes no new requests")

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop ``request_id`` wherever it is in this worker and free what it holds."""

    @abstractmethod
    def busy(self) -> bool:
        """Whether there is work for :meth:`step` now (then messages are read without waiting)."""

    @abstractmethod
    def step(self) -> None:
        """Run one iteration of the role's work (a batch, a hand-off pass, ...)."""

    @abstractmethod
    def load_report(self) -> dict[str, int]:
        """``running``, ``waiting``, ``ring_slots_used``, ``queued_tokens``, ``num_preemptions``
        and ``num_encoded_images`` of :class:`~mm_serve.runtime.messages.WorkerStats` (and, for
        roles with caches, their counters: ``worker_setup.cache_report``)."""

    def replace_ring(self, msg: messages.ReplaceRing) -> None:
        """A peer was restarted with a fresh ring (roles with rings; default: nothing to do)."""
        return None

    def periodic(self) -> None:
        """Chores run with each stats report (default: none)."""
        return None

    def release_resources(self) -> None:
        """Close what :meth:`load` opened besides the channel (rings, doorbells; default: none)."""
        return None

    def wait_ms(self) -> int:
        """Milliseconds the loop may wait for a control message before the next :meth:`step`
        (a message or a doorbell ends the wait early): none while busy, :attr:`idle_wait_ms`
        while idle. A role that paces its steps waits out the time to its next one."""
        return 0 if self.busy() else self.idle_wait_ms

    # ---- the shell ----------------------------------------------------------------------------

    def send(self, updates: list[messages.TokenUpdate], step: messages.StepTiming | None = None) -> None:
        """Report token updates of one step (and its timing) to the front end (nothing when empty)."""
        if updates:
            self.channel.send(messages.TokenBatch(self.role, self.spec.index, updates, step))
        if step is not None and self.step_log is not None:
            self.step_log.write(step)

    def send_stats(self) -> None:
        pool = self.kv_cache.pool
        self.channel.send(messages.WorkerStats(
            role=self.role, index=self.spec.index, pid=os.getpid(), kv_pages_used=pool.num_used,
            kv_pages_total=pool.num_pages, pages_integrity_ok=pool.integrity_ok(), **self.load_report(),
        ))

    def _on_message(self, msg: object) -> bool:
        """Handle one control message; returns False on :class:`~mm_serve.runtime.messages.Shutdown`."""
        if isinstance(msg, messages.PrefillRequest):
            self.accept(msg)
        elif isinstance(msg, messages.AbortRequest):
            self.abort(msg.request_id)
        elif isinstance(msg, messages.StatsQuery):
            self.send_stats()
        elif isinstance(msg, messages.ReplaceRing):
            self.replace_ring(msg)
        elif isinstance(msg, messages.Shutdown):
            return False
        return True

    def serve(self) -> None:
        """Freeze the start-up heap (:func:`~mm_serve.runtime.heap_freeze.freeze_startup_heap`: no
        full garbage collection walks the model's and the imports' objects mid-step), report
        ready, then loop until :class:`~mm_serve.runtime.messages.Shutdown` or the parent dies."""
        freeze_startup_heap()
        self.channel.send(messages.WorkerReady(self.role, self.spec.index, os.getpid(), self.kv_cache.num_pages,
                                               self.warm_up_error))
        # off the first structured request, now that the worker serves (a warm-up before "ready" lengthened the start)
        self.grammars.warm_in_background(self.model_config.text.vocab_size)
        running = True
        while running and self.channel.parent_alive():
            for msg in self.channel.recv(self.wait_ms()):
                running = running and self._on_message(msg)
            self.step()
            if time.monotonic() >= self._next_stats:
                self._next_stats = time.monotonic() + self.spec.stats_interval_s
                self.periodic()
                self.send_stats()

    def close(self) -> None:
        self.grammars.close()  # a warm-up under way ends first: exiting in its middle aborts the process
        self.release_resources()
        self.channel.close()
        if self.step_log is not None:
            self.step_log.close()
