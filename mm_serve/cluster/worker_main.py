"""Process entry point of a worker: ``python -m mm_serve.cluster.worker_main SPEC_JSON``."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any

from mm_serve.ground.roles import Role

if TYPE_CHECKING:
    from mm_serve.runtime.worker_shell import WorkerShell


def worker_class(role: Role) -> type[WorkerShell]:
    """The :class:`~mm_serve.runtime.worker_shell.WorkerShell` subclass of ``role`` (imported
    here, so a process loads only its own stage)."""
    if role is Role.PREFILL:
        from mm_serve.vision_prefill.prefill_worker import PrefillWorker

        return PrefillWorker
    if role is Role.DECODE:
        from mm_serve.text_decode.decode_worker import DecodeWorker

        return DecodeWorker
    from mm_serve.colocated.colocated_worker import ColocatedWorker

    return ColocatedWorker


def main(argv: list[str]) -> int:
    """Build the worker named by the spec's role and serve until shutdown (exit 0; 1 on a
    crash, with its traceback in the worker's log; 2 for a spec that does not decode, such as
    one of an unknown role)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The front end decides when workers stop (a Shutdown message, or its own exit): a signal to
    # the whole process group (Ctrl-C, systemd, a container runtime) drains the service first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import msgspec

    from mm_serve.runtime.worker_spec import decode_spec

    try:
        spec = decode_spec(argv[1])
    except msgspec.ValidationError as exc:
        print(f"invalid worker spec: {exc}", file=sys.stderr)
        return 2
    return run_worker(spec)


def run_worker(spec: Any, *args: Any) -> int:
    """Build ``spec``'s role worker (``args`` after the spec: a Ray actor's link), serve until
    Shutdown and close: 0; 1 on a crash (its traceback printed to the worker's log); 2 for a checkpoint
    that cannot be loaded (one line: what is wrong with it)."""
    from mm_serve.cluster.worker_state import USER_ERROR_EXIT
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.runtime.heap_freeze import defer_collection

    defer_collection()  # until the worker is loaded (WorkerShell.serve freezes its heap); a Ray actor enters here too
    from mm_serve.runtime.malloc_tuning import tune_malloc_for_inference

    tune_malloc_for_inference()
    try:
        worker = worker_class(spec.role)(spec, *args)
        worker.serve()
        worker.close()
        return 0
    except CheckpointError as exc:  # the user's checkpoint, not a crash: its message says what is wrong
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
