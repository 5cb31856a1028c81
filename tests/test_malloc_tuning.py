"""glibc malloc tuning: large blocks come from the heap and stay there after free."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

# In a fresh process: malloc 16 MB, report whether it was mmapped (mallinfo2's hblks grew),
# free it, report the heap size (arena) left. argv[1] == "tune" applies the tuning first.
_SCRIPT = """
import ctypes, sys
from mm_serve.runtime.malloc_tuning import tune_malloc_for_inference
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
tuned = tune_malloc_for_inference() if sys.argv[1] == "tune" else False
assert sys.argv[1] != "tune" or tune_malloc_for_inference() == tuned  # a second call: the first result
before = libc.mallinfo2().hblks
block = libc.malloc(16 << 20)
mmapped = libc.mallinfo2().hblks - before
libc.free(block)
print(tuned, mmapped, libc.mallinfo2().arena >> 20)
"""


def _run(mode: str, **extra_env: str) -> tuple[bool, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra_env
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, env=env, check=True)
    tuned, mmapped, arena_mb = out.stdout.split()
    return tuned == "True", int(mmapped), int(arena_mb)


def test_large_blocks_come_from_the_heap_and_are_kept_after_free() -> None:
    assert _run("default")[1] == 1  # glibc's default: a fresh mmap, unmapped again on free
    tuned, mmapped, arena_mb = _run("tune")
    assert tuned
    assert mmapped == 0  # served from the heap
    assert arena_mb >= 16  # and not trimmed away on free: the next batch reuses the pages


def test_user_malloc_variables_win() -> None:
    tuned, mmapped, _ = _run("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert not tuned
    assert mmapped == 1


def test_skip_note_is_printed_once() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"MALLOC_TRIM_THRESHOLD_": "131072"}
    script = "from mm_serve.runtime.malloc_tuning import tune_malloc_for_inference as t; print(t(), t(), t())"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
    assert out.stderr.count("malloc tuning skipped: MALLOC_TRIM_THRESHOLD_ set by the user") == 1


def test_glibc_tunables_win() -> None:
    tuned, mmapped, _ = _run("tune", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    assert not tuned
    assert mmapped == 1
