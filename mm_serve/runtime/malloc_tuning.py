"""Keep glibc malloc from handing activation memory back to the kernel between forward passes.

A CPU forward pass allocates and frees megabytes of activations (a prefill batch of
16 images: ~7 MB per MLP output). With glibc's defaults, blocks above the mmap
threshold come from fresh ``mmap`` s and free memory at the top of the heap is
trimmed, so every batch page-faults its activations in again (zero-filled by the
kernel): 20-30 % of a prefill worker's time on the caption job. Raising the mmap
threshold to its maximum and the trim threshold well above a batch's working set
keeps those pages in the process, as the tcmalloc/jemalloc preload recommended for
vLLM's and IPEX's CPU backends does. Set through ``mallopt(3)`` at start-up; the
same knobs as the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt(3) parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 512 << 20  # free heap kept before trimming: several batches' activations

_result: bool | None = None  # the first call's outcome; later calls return it


def tune_malloc_for_inference() -> bool:
    """Apply the thresholds above to this process's glibc malloc (once; later calls return the first result).

    Skipped when the process is not on glibc, or when the user set either threshold
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or ``glibc.malloc.mmap_threshold``
    / ``trim_threshold`` in ``GLIBC_TUNABLES``): their choice wins, with a note on stderr
    since it can halve a prefill worker's throughput.

    Returns:
        True when the thresholds are (now or already) set by this function.
    """
    global _result
    if _result is None:
        _result = _tune()
    return _result


def _tune() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    user = sorted(os.environ.keys() & {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"})
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    user += [name for name in ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold") if name in tunables]
    if user:
        print(f"[mm-serve {os.getpid()}] malloc tuning skipped: {', '.join(user)} set by the user", file=sys.stderr)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def release_free_heap() -> bool:
    """Return this process's free heap to the system now (glibc ``malloc_trim(0)``), e.g. after a
    one-off engine was dropped in a process that keeps running; False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
