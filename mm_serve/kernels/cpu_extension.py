"""Build, cache and load the compiled CPU kernels (``kernels/csrc/*.cpp``).

The C++ sources are compiled on first use with ``torch.utils.cpp_extension`` (``c++`` or
``$CXX``, and ninja; ~15 s once) into one library in a per-user cache folder keyed by the sources,
the flags, the torch version and this CPU, whose ops register as ``torch.ops.mm_serve_cpu``
(``paged_decode_attention``, ``rope_paged_decode_attention``, ``rms_norm``). A finished
build is marked, and later processes load it directly (milliseconds; no compiler or write
access needed); concurrent first builds (several worker processes) wait on one lock
(``flock``, released if its holder dies). ``python -m mm_serve.kernels.cpu_extension`` builds ahead
of time (``make install`` does; :class:`~mm_serve.engine.engine_client.EngineClient` does
before it starts CPU workers, so messages reach its terminal). Where the build
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


def library_path() -> Path:
    """The compiled library for this source/flags/torch/CPU combination (it may not exist yet)."""
    tag = build_tag()
    return cache_root() / "kernels" / f"cpu_kernels_{tag}" / f"mm_serve_cpu_kernels_{tag}.so"


def _built_marker(library: Path) -> Path:
    return library.with_suffix(".built")


def _finished(library: Path) -> bool:
    return library.is_file() and _built_marker(library).is_file()


def is_built() -> bool:
    """Whether :func:`library_path` holds a finished build (loadable without a compiler)."""
    return _finished(library_path())


def _registered() -> Any | None:
    """``torch.ops.mm_serve_cpu`` if this process already loaded the library (a namespace registers once)."""
    try:
        torch.ops.mm_serve_cpu.paged_decode_attention  # noqa: B018 - raises until the library is loaded
    except (AttributeError, RuntimeError):
        return None
    return torch.ops.mm_serve_cpu


def _ninja_path() -> str:
    """PATH with the pip ``ninja`` (a dependency) first: the same ninja for every build, so one
    ninja's log does not make another rebuild, and one even where the venv is not activated."""
    path = os.environ.get("PATH", "")
    try:
        import ninja
    except ImportError:
        return path  # a system ninja, if any
    return ninja.BIN_DIR + os.pathsep + path


def _build(library: Path) -> Any:
    """Compile ``library`` under a lock, mark it finished, load it. Raises on any failure."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set $CXX)")
    # cpp_extension logs a CUDA_HOME notice at import on machines without CUDA; not ours to show.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    build_dir = library.parent
    build_dir.mkdir(parents=True, exist_ok=True)
    # Our own lock, which the kernel drops when its holder dies: the lock file of older
    # torch versions' cpp_extension (FileBaton) outlives a build that was killed (Ctrl-C at
    # first start) and makes every later start wait for it forever, so while holding ours,
    # a leftover one is removed.
    with open(build_dir / "mm-serve.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if _finished(library):  # another process finished it while this one waited
            torch.ops.load_library(str(library))
            return torch.ops.mm_serve_cpu
        (build_dir / "lock").unlink(missing_ok=True)
        print(f"mm-serve: building the CPU kernels in {build_dir} (once, ~15 s)", file=sys.stderr, flush=True)
        saved_path = os.environ.get("PATH")
        os.environ["PATH"] = _ninja_path()
        try:
            cpp_extension.load(  # copies of the flag lists: load() appends to the lists it is given
                name=library.stem, sources=[str(source) for source in SOURCES], extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), is_python_module=False, verbose=False,
            )
        finally:
            if saved_path is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = saved_path
        _built_marker(library).touch()
    return torch.ops.mm_serve_cpu


def _load_or_build() -> Any:
    ops = _registered()
    if ops is not None:
        return ops
    library = library_path()  # hashes the sources and reads /proc/cpuinfo: once
    if _finished(library):  # no lock, no compiler: works from a read-only cache too
        torch.ops.load_library(str(library))
        return torch.ops.mm_serve_cpu
    return _build(library)


def _reason(exc: Exception) -> str:
    """The compiler's first error lines from a build failure, else the message (its end if long)."""
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
                _loaded["ops"] = _load_or_build()
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
                _loaded["ops"] = None
                warnings.warn(
                    f"compiled CPU kernels unavailable ({type(exc).__name__}: {_reason(exc)}); "
                    "using the plain-torch reference (set cpu_kernels: torch to silence this)",
                    RuntimeWarning, stacklevel=2,
                )
        return _loaded["ops"]


def main() -> int:
    """``python -m mm_serve.kernels.cpu_extension``: build (or find) the library now; 0 if it loads, else 1
    (the reason on one ``mm-serve: warning:`` line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = cpu_kernel_ops()
    for warning in caught:
        print(f"mm-serve: warning: {warning.message}", file=sys.stderr)
    if ops is None:
        return 1
    print(f"mm-serve: CPU kernels ready: {library_path()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
