"""Process entry point of a worker: ``python -m mm_serve.engine.worker_main SPEC_JSON``."""

from __future__ import annotations

import os
import signal
import sys
import traceback


def main(argv: list[str]) -> int:
    """Build the worker named by the spec's role and serve until shutdown."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when workers stop
    from mm_serve.engine.worker_spec import decode_spec

    spec = decode_spec(argv[1])
    from mm_serve.engine.malloc_tuning import tune_malloc_for_inference

    tune_malloc_for_inference()
    try:
        if spec.role == "prefill":
            from vision_prefill.prefill_worker import PrefillWorker

            worker: object = PrefillWorker(spec)
        elif spec.role == "decode":
            from text_decode.decode_worker import DecodeWorker

            worker = DecodeWorker(spec)
        elif spec.role == "colocated":
            from mm_serve.engine.colocated_worker import ColocatedWorker

            worker = ColocatedWorker(spec)
        else:
            print(f"unknown worker role {spec.role!r}", file=sys.stderr)
            return 2
        worker.serve()  # type: ignore[attr-defined]
        worker.close()  # type: ignore[attr-defined]
        return 0
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
