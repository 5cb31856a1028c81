"""Build the compiled CPU kernels (:mod:`mm_serve.kernels.cpu_extension`) once, before CPU workers start.

Workers log to files; building here, in a child process of the front end, puts the build
message or the fallback warning on the service's terminal, once, and lets a stop request
kill the compiler with it (its own process group). If the build fails, workers run
``cpu_kernels: torch`` instead of each failing the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgspec

from mm_serve.ground.console import say
from mm_serve.runtime.worker_spec import WorkerSpec

CPU_KERNEL_BUILD_TIMEOUT_S = 300.0  # a normal build takes ~15 s on 2 cores


class BuildStopped(RuntimeError):
    """The service was told to stop while the kernels were building."""


def prebuild_cpu_kernels(specs: list[WorkerSpec], stopping: threading.Event) -> list[WorkerSpec]:
    """Build the kernels if any worker wants them and they are not built yet.

    Returns:
        ``specs``, with ``sizing.cpu_kernels`` set to ``"torch"`` for the workers that wanted
        the compiled kernels when the build failed, timed out (after
        :data:`CPU_KERNEL_BUILD_TIMEOUT_S` seconds) or was killed.

    Raises:
        BuildStopped: ``stopping`` was set during the build (the compiler is stopped first).
    """
    wanted = [s.sizing.compiled_cpu_kernels for s in specs]
    if not any(wanted):
        return specs
    from mm_serve.kernels.cpu_extension import is_built

    try:
        if is_built():
            return specs
    except OSError:
        pass  # sources missing or unreadable: the child says so, workers use torch kernels
    build = subprocess.Popen([sys.executable, "-m", "mm_serve.kernels.cpu_extension"], start_new_session=True)
    deadline = time.monotonic() + CPU_KERNEL_BUILD_TIMEOUT_S
    try:
        while build.poll() is None:
            if stopping.is_set():
                raise BuildStopped("stopped while the workers were starting")
            if time.monotonic() > deadline:  # a hung compiler, or another build stopped holding the lock
                say(f"mm-serve: warning: building the CPU kernels took over {CPU_KERNEL_BUILD_TIMEOUT_S:.0f} s; "
                    "stopped it, workers use the torch kernels")
                break
            time.sleep(0.1)
    finally:
        if build.poll() is None:
            _stop(build)
    if build.returncode is not None and build.returncode < 0 and time.monotonic() <= deadline:
        say(f"mm-serve: warning: building the CPU kernels was killed (signal {-build.returncode}); "
            "workers use the torch kernels")
    if build.returncode == 0:
        return specs
    replace = msgspec.structs.replace
    return [replace(s, sizing=s.sizing.replace(cpu_kernels="torch")) if w else s
            for s, w in zip(specs, wanted, strict=True)]


def _stop(build: subprocess.Popen[bytes]) -> None:
    """SIGTERM first: ninja runs each compiler in a process group of its own and stops them
    itself when it is told to stop, which SIGKILL would not let it do."""
    os.killpg(build.pid, signal.SIGTERM)
    try:
        build.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
