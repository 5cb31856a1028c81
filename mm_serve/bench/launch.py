"""Start and stop our own server for a benchmark (``mm-serve bench --config`` / ``--compare``).

:class:`LocalServer` runs ``mm-serve serve`` as a child process on a free port of
127.0.0.1 with a given config and mode, waits until ``/health`` answers 200 (the
workers are loaded and warmed up), and stops it with SIGINT (then SIGKILL) on exit, also
when the benchmark itself is stopped with SIGTERM.
Both modes of a comparison are started from the same config file, so they get the
same model, dtype and cores: disaggregated mode pins prefill and decode workers to
``compute.prefill_cpus`` / ``decode_cpus``, colocated mode gives its single worker
the union of those cores (every core when both lists are empty).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx


class LaunchError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log tail."""


def wait_while_warming(url: str, timeout_s: float = 600.0, api_key: str | None = None,
                       log: Callable[[str], None] = print) -> None:
    """Wait while ``url``'s ``/health`` answers 503 (a server still loading or warming its workers), up to
    ``timeout_s`` seconds; any other answer (200, a server without ``/health``, no answer) returns at once,
    for the run itself to report.

    Raises:
        LaunchError: still 503 after ``timeout_s`` seconds.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, said = time.monotonic() + timeout_s, False
    with httpx.Client(trust_env=False, timeout=5.0, headers=headers) as http:
        while True:
            try:
                answer = http.get(f"{url.rstrip('/')}/health")
            except httpx.HTTPError:
                return
            if answer.status_code != 503:
                return
            if time.monotonic() >= deadline:
                raise LaunchError(f"{url}/health still answered 503 after {timeout_s:.0f} s: {answer.text[:200]}")
            if not said:
                log(f"{url}/health answers 503 (starting or warming up): waiting up to {timeout_s:.0f} s")
                said = True
            time.sleep(1.0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unwind_on_sigterm() -> None:
    """Make SIGTERM (``kill``, a CI timeout) unwind the benchmark like Ctrl-C does, so every
    ``with LocalServer(...)`` stops its server instead of leaving it running, orphaned. Only
    from the main thread and only where SIGTERM still has its default action."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


class LocalServer:
    """``mm-serve serve`` in a child process; use as a context manager.

    Args:
        log_path: file that receives the server's stdout and stderr.
        config: YAML config file, or None for the defaults.
        model: checkpoint directory overriding the config's ``model``.
        mode: ``"disaggregated"`` or ``"colocated"``, overriding the config's ``mode``.
        served_model_name: the model id clients send.
        extra_args: more ``mm-serve serve`` options (e.g. ``["--no-admission"]``).
    """

    def __init__(self, log_path: Path, config: str | None = None, model: str | None = None,
                 mode: str | None = None, served_model_name: str = "bench",
                 extra_args: tuple[str, ...] = ()) -> None:
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served_model_name = served_model_name
        self._cmd = [sys.executable, "-m", "mm_serve.cli.main", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--served-model-name", served_model_name]
        for flag, value in (("--config", config), ("--model", model), ("--mode", mode)):
            if value is not None:
                self._cmd += [flag, value]
        self._cmd += list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> str:
        """Start the server and wait for ``/health`` 200; returns its base URL.

        Raises:
            LaunchError: the process exited, or was not healthy within ``timeout_s`` seconds.
        """
        _unwind_on_sigterm()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(trust_env=False, timeout=5.0) as http:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise LaunchError(f"the server exited with status {self._proc.returncode}:\n{self.log_tail()}")
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise LaunchError(f"the server was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """Stop the server (SIGINT, then SIGKILL after 30 s); returns its exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    @property
    def pid(self) -> int | None:
        """The server process's pid (the API process; its workers are children), None before start."""
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log."""
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
