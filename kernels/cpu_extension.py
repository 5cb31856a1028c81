"""Build, cache and load the compiled CPU kernels (``kernels/csrc/*.cpp``).

The C++ sources are compiled on first use with ``torch.utils.cpp_extension`` (g++ and
ninja, ~15 s once) into one library in a per-user cache folder keyed by the sources,
the flags, the torch version and this CPU, whose ops register as ``torch.ops.mm_serve_cpu``
(``paged_decode_attention``, ``rope_paged_decode_attention``, ``rms_norm``). Later
processes load the cached library in milliseconds; concurrent first uses (several worker
processes) wait on one lock (``flock``, released if its holder dies). Where the build
fails (no C++ compiler, say) callers fall back to the plain-torch reference and one
warning says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode_attention_cpu.cpp", "rms_norm_cpu.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # cpp_extension adds the C++ standard torch needs
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def cache_root() -> Path:
    """Where compiled kernels live: ``$MM_SERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mm-serve``, else ``~/.cache/mm-serve``."""
    if os.environ.get("MM_SERVE_CACHE_DIR"):
        return Path(os.environ["MM_SERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mm-serve"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_tag() -> str:
    """Short hash of what the binary depends on: sources, flags, torch version, CPU features."""
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES), " ".join(CFLAGS + LDFLAGS).encode(),
                 torch.__version__.encode(), platform.machine().encode(), _cpu_flags().encode()):
        digest.update(part)
    return digest.hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip ``ninja`` package (a dependency) brings one
    that is not on PATH when the virtual environment is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # the build then fails with cpp_extension's own message
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build() -> Any:
    # cpp_extension logs a CUDA_HOME notice at import on machines without CUDA; not ours to show.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    tag = build_tag()
    build_dir = cache_root() / "kernels" / f"cpu_kernels_{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    name = f"mm_serve_cpu_kernels_{tag}"
    # Our own lock, which the kernel drops when its holder dies: the lock file of older
    # torch versions' cpp_extension (FileBaton) outlives a build that was killed (Ctrl-C at
    # first start) and makes every later start wait for it forever, so while holding ours,
    # a leftover one is removed.
    with open(build_dir / "mm-serve.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        if not (build_dir / f"{name}.so").exists():
            print(f"mm-serve: building the CPU kernels in {build_dir} (once, ~15 s)", file=sys.stderr, flush=True)
        cpp_extension.load(
            name=name, sources=[str(source) for source in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
            build_directory=str(build_dir), is_python_module=False, verbose=False,
        )
    return torch.ops.mm_serve_cpu


def _reason(exc: Exception) -> str:
    """The compiler's first error lines from a build failure, else the message's end."""
    text = str(exc)
    errors = [line.strip() for line in text.splitlines()
              if "error" in line.lower() and not line.startswith("Error building extension") and "ninja" not in line]
    picked = "; ".join(errors[:3]) if errors else text
    return picked if len(picked) <= 400 else "..." + picked[-400:]


def cpu_kernel_ops() -> Any | None:
    """The compiled ops' namespace ``torch.ops.mm_serve_cpu``, or None where it cannot be built.

    ``paged_decode_attention(query [B, Hq, D], k_cache, v_cache [P, S, Hkv, D], block_tables
    [B, max_pages] int64, context_lens [B] int64, scale) -> [B, Hq, D]`` and
    ``rope_paged_decode_attention(qkv [B, (Hq + 2 Hkv) * D], cos, sin [B, D], num_heads, k_cache,
    v_cache, block_tables, context_lens, scale) -> [B, Hq, D]`` (writes the new K/V), and
    ``rms_norm(x [..., H], weight [H], eps) -> [..., H]``; float32 on a CPU; wrong inputs
    raise ``RuntimeError`` naming the problem.

    Built at most once per process; a failed build warns once (``RuntimeWarning``) and
    is not retried.
    """
    with _lock:
        if "ops" not in _loaded:
            try:
                _loaded["ops"] = _build()
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
                _loaded["ops"] = None
                warnings.warn(
                    f"compiled CPU kernels unavailable ({type(exc).__name__}: {_reason(exc)}); "
                    "using the plain-torch reference (set cpu_kernels: torch to silence this)",
                    RuntimeWarning, stacklevel=2,
                )
        return _loaded["ops"]
